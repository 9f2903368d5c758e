"""Export the default job for the peer: the 10 IID partitions, the test split, the weights.

Run in this project's environment: ``python benchmarks/peer/export_job.py JOB.pt``. The file
holds exactly what ``python -m experiments.run`` trains on: each client's partition as
the ClientApps build it, the held-out digits the central evaluation uses, and the
SmallCNN's initial state dict (the same seed).
"""

import sys

import torch

from protocols import compose_config
from splitlearn.config import to_object
from splitlearn.data import held_out_dataset
from splitlearn.data.loaders import client_dataset
from splitlearn.models.factory import build_model_from_config


def export(path: str) -> None:
    """Write the default job's partitions, test split and initial weights to ``path``."""
    cfg = compose_config(["logger=none"])
    dataset, partitioner = to_object(cfg.dataset), to_object(cfg.partitioner)
    parts = [client_dataset(dataset, partitioner, seed=cfg.seed, partition_id=i,
                            num_partitions=cfg.num_clients).tensors
             for i in range(cfg.num_clients)]
    model = build_model_from_config(to_object(cfg.model), dataset, seed=cfg.seed)
    torch.save({"parts": parts, "test": held_out_dataset(dataset, seed=cfg.seed).tensors,
                "state": model.state_dict()}, path)


if __name__ == "__main__":
    export(sys.argv[1])
