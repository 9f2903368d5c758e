"""Build flwr-datasets partitioners by name and cut datasets into partitions.

Every partitioner is seeded explicitly, so each client that rebuilds the
partitioner with the same arguments computes the very same partitioning and
can load only its own share without any coordination.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # flwr-datasets imports its plotting stack (seconds): only where used
    import datasets
    from flwr_datasets.partitioner import Partitioner

# Smallest partition the Dirichlet partitioner accepts before it resamples.
# With self-balancing, 2 never failed for the digits train split (1437 rows)
# over 10..100 partitions at alpha >= 0.1..0.5 (100 seeds each), whereas 5 and
# 10 exhaust flwr-datasets' 10 resampling attempts at 50..100 partitions.
DIRICHLET_MIN_PARTITION_SIZE = 2


def _build_iid(
    *, num_partitions: int, seed: int, alpha: float, shards: int, partition_by: str
) -> Partitioner:
    """IID: contiguous equal slices (the data is shuffled beforehand)."""
    from flwr_datasets.partitioner import IidPartitioner

    return IidPartitioner(num_partitions=num_partitions)


def _build_dirichlet(
    *, num_partitions: int, seed: int, alpha: float, shards: int, partition_by: str
) -> Partitioner:
    """Label skew: per-class shares drawn from Dirichlet(alpha)."""
    from flwr_datasets.partitioner import DirichletPartitioner

    return DirichletPartitioner(
        num_partitions=num_partitions,
        partition_by=partition_by,
        alpha=float(alpha),
        min_partition_size=DIRICHLET_MIN_PARTITION_SIZE,
        # Self-balancing stops feeding partitions that are already above the
        # average size, which keeps tiny datasets from leaving clients empty.
        self_balancing=True,
        shuffle=True,
        seed=seed,
    )


def _build_shards(
    *, num_partitions: int, seed: int, alpha: float, shards: int, partition_by: str
) -> Partitioner:
    """Pathological non-IID: label-sorted shards, a few per partition."""
    from flwr_datasets.partitioner import ShardPartitioner

    return ShardPartitioner(
        num_partitions=num_partitions,
        partition_by=partition_by,
        num_shards_per_partition=shards,
        shuffle=True,
        seed=seed,
    )


_PARTITIONER_BUILDERS: MappingProxyType[str, Callable[..., Partitioner]] = MappingProxyType(
    {
        "iid": _build_iid,
        "dirichlet": _build_dirichlet,
        "shards": _build_shards,
    }
)
PARTITIONER_NAMES: tuple[str, ...] = tuple(_PARTITIONER_BUILDERS)


def make_partitioner(
    name: str,
    *,
    num_partitions: int,
    seed: int,
    alpha: float = 0.5,
    shards_per_partition: int = 2,
    partition_by: str = "label",
) -> Partitioner:
    """Create a seeded flwr-datasets partitioner from its short name.

    Parameters
    ----------
    name : str
        One of ``"iid"`` (``IidPartitioner``), ``"dirichlet"``
        (``DirichletPartitioner`` with ``self_balancing=True`` and
        ``min_partition_size=DIRICHLET_MIN_PARTITION_SIZE`` (2), chosen so that
        ~1400 samples split over up to 100 clients without failure) or
        ``"shards"`` (``ShardPartitioner``, pathological label shards).
    num_partitions : int
        Number of clients the data is split across; at least 1.
    seed : int
        Seed of the partitioner's random generator (unused by ``"iid"``, which
        slices the already shuffled data).
    alpha : float, optional
        Dirichlet concentration, strictly positive; only used by
        ``"dirichlet"``. Smaller means more label skew.
    shards_per_partition : int, optional
        Shards each partition receives; only used by ``"shards"``.
    partition_by : str, optional
        Label column the non-IID partitioners split on.

    Returns
    -------
    Partitioner
        A partitioner with no dataset assigned yet.

    Raises
    ------
    ValueError
        If ``name`` is unknown, ``num_partitions < 1``, ``alpha <= 0`` for
        ``"dirichlet"`` or ``shards_per_partition < 1`` for ``"shards"``.
    """
    builder = _PARTITIONER_BUILDERS.get(name)
    if builder is None:
        accepted = ", ".join(PARTITIONER_NAMES)
        raise ValueError(f"Unknown partitioner {name!r}; accepted names: {accepted}")
    _check_partitioner_args(
        name,
        num_partitions=num_partitions,
        alpha=alpha,
        shards_per_partition=shards_per_partition,
    )
    return builder(
        num_partitions=num_partitions,
        seed=seed,
        alpha=alpha,
        shards=shards_per_partition,
        partition_by=partition_by,
    )


def _check_partitioner_args(
    name: str, *, num_partitions: int, alpha: float, shards_per_partition: int
) -> None:
    """Reject arguments the chosen partitioner cannot work with."""
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if name == "dirichlet" and not alpha > 0:
        raise ValueError(f"alpha must be > 0 for dirichlet partitioning, got {alpha}")
    if name == "shards" and shards_per_partition < 1:
        raise ValueError(f"shards_per_partition must be >= 1, got {shards_per_partition}")


def partition_dataset(
    dataset: datasets.Dataset, partitioner: Partitioner, partition_id: int
) -> datasets.Dataset:
    """Assign ``dataset`` to ``partitioner`` and load one partition.

    Parameters
    ----------
    dataset : datasets.Dataset
        The full split to partition (usually the training split).
    partitioner : Partitioner
        A partitioner, e.g. from :func:`make_partitioner`. A partitioner can
        hold one dataset only: when it already holds one, ``dataset`` is
        assumed to be that same data and the cached partitioning is reused.
    partition_id : int
        Index in ``0 .. num_partitions - 1``.

    Returns
    -------
    datasets.Dataset
        The rows of partition ``partition_id``.

    Raises
    ------
    ValueError
        If ``partition_id`` is out of range, or the partitioner already holds
        a dataset with a different number of rows.
    """
    _assign_dataset(partitioner, dataset)
    check_partition_id(partition_id, partitioner.num_partitions)
    return partitioner.load_partition(partition_id)


def check_partition_id(partition_id: int, num_partitions: int) -> None:
    """Raise if ``partition_id`` is not in ``0 .. num_partitions - 1``.

    Parameters
    ----------
    partition_id : int
        Index to check.
    num_partitions : int
        Number of partitions.

    Raises
    ------
    ValueError
        If the index is out of range (partitioners would otherwise fail with
        a KeyError or silently return wrong data).
    """
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id must be in [0, {num_partitions - 1}], got {partition_id}")


def _assign_dataset(partitioner: Partitioner, dataset: datasets.Dataset) -> None:
    """Give the partitioner its dataset unless it already holds the same data."""
    if not partitioner.is_dataset_assigned():
        partitioner.dataset = dataset
        return
    # ShardPartitioner swaps in a label-sorted copy, so identity cannot be used;
    # the row count catches the likely mistake of passing another split.
    if partitioner.dataset.num_rows != dataset.num_rows:
        raise ValueError(
            "partitioner already holds a dataset with "
            f"{partitioner.dataset.num_rows} rows, got one with {dataset.num_rows}; "
            "create a new partitioner for a different dataset"
        )
