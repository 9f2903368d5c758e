"""Datasets, partitioning and torch loaders for federated split learning."""

from __future__ import annotations

from splitlearn.data.digits import load_digits_splits
from splitlearn.data.loaders import (
    KNOWN_DATASETS,
    DatasetSpec,
    check_dataset_config,
    client_dataset,
    describe_dataset,
    held_out_dataset,
    load_client_data,
    load_test_data,
    local_dataset,
    to_tensor_dataset,
)
from splitlearn.data.partition import (
    DIRICHLET_MIN_PARTITION_SIZE,
    PARTITIONER_NAMES,
    check_partition_id,
    make_partitioner,
    partition_dataset,
)

__all__ = [
    "DIRICHLET_MIN_PARTITION_SIZE",
    "KNOWN_DATASETS",
    "PARTITIONER_NAMES",
    "DatasetSpec",
    "check_dataset_config",
    "client_dataset",
    "held_out_dataset",
    "check_partition_id",
    "describe_dataset",
    "load_client_data",
    "load_digits_splits",
    "load_test_data",
    "local_dataset",
    "make_partitioner",
    "partition_dataset",
    "to_tensor_dataset",
]
