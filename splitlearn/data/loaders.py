"""Load client partitions and the central test set as torch TensorDatasets.

Three sources are supported:

* ``"digits"``: scikit-learn's bundled 8x8 digits (offline, see
  :mod:`splitlearn.data.digits`); its train part is partitioned, its held-out
  part is the test set.
* ``"synthetic"``: 8x8 examples each device generates for itself, any number of
  devices with ``samples_per_client`` each (offline, see
  :mod:`splitlearn.data.synthetic`); the partitioner does not apply.
* ``"mnist"``, ``"fashion_mnist"``, ``"cifar10"``: loaded through
  ``flwr_datasets.FederatedDataset`` from the HuggingFace Hub id, or from a
  local folder when ``path`` is given.

Local folder format
-------------------
``path`` must be a folder that ``datasets.load_dataset(path)`` reads as a
``DatasetDict`` with ``"train"`` and ``"test"`` splits: parquet files whose
names start with the split name, e.g. ``train.parquet`` and ``test.parquet``
(or ``train-00000-of-00001.parquet`` ..., also inside one subfolder such as
``mnist/``), holding the columns listed in ``_KNOWN_DATASETS`` (images as a
``datasets.Image()`` feature, labels as integers or a ``ClassLabel``).
``Dataset.to_parquet`` writes such files, and a snapshot of the Hub
repository (e.g. ``ylecun/mnist``) has this layout. Folders written by
``DatasetDict.save_to_disk`` are *not* supported.

Images are returned as float32 tensors of shape (N, C, H, W) in [0, 1] and
labels as int64 tensors of shape (N,).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import TensorDataset

from splitlearn.config import DatasetConfig, PartitionerConfig
from splitlearn.data.digits import load_digits_splits
from splitlearn.data.partition import (
    check_partition_id,
    make_partitioner,
    partition_dataset,
)
from splitlearn.data.synthetic import synthetic_partition, synthetic_test

if TYPE_CHECKING:
    # Imported where used: a device's ClientApp process (one per Flower message in the
    # Deployment Engine) needs neither flwr-datasets' plotting stack nor HF datasets
    # unless it partitions (seconds of every message's start-up otherwise).
    import datasets
    from flwr_datasets.partitioner import Partitioner


@dataclass(frozen=True)
class DatasetSpec:
    """What a model needs to know about the data.

    Attributes
    ----------
    name : str
        Dataset name as accepted by the loaders.
    in_channels : int
        Image channels (1 for grey, 3 for RGB).
    image_size : int
        Height and width of the square images.
    num_classes : int
        Number of label classes.
    """

    name: str
    in_channels: int
    image_size: int
    num_classes: int


@dataclass(frozen=True)
class _DatasetSource:
    """Where a dataset comes from and how its columns are named."""

    spec: DatasetSpec
    hub_id: str | None  # None: built locally (digits), not via flwr-datasets
    image_key: str
    label_key: str


_KNOWN_DATASETS: MappingProxyType[str, _DatasetSource] = MappingProxyType(
    {
        "digits": _DatasetSource(DatasetSpec("digits", 1, 8, 10), None, "image", "label"),
        "synthetic": _DatasetSource(DatasetSpec("synthetic", 1, 8, 10), None, "image", "label"),
        "mnist": _DatasetSource(DatasetSpec("mnist", 1, 28, 10), "ylecun/mnist", "image", "label"),
        "fashion_mnist": _DatasetSource(
            DatasetSpec("fashion_mnist", 1, 28, 10),
            "zalando-datasets/fashion_mnist",
            "image",
            "label",
        ),
        "cifar10": _DatasetSource(
            DatasetSpec("cifar10", 3, 32, 10), "uoft-cs/cifar10", "img", "label"
        ),
    }
)
KNOWN_DATASETS: tuple[str, ...] = tuple(_KNOWN_DATASETS)


def _dataset_source(name: str) -> _DatasetSource:
    """Look up a dataset by name, naming the known ones on failure."""
    source = _KNOWN_DATASETS.get(name)
    if source is None:
        raise ValueError(f"Unknown dataset {name!r}; known datasets: {', '.join(KNOWN_DATASETS)}")
    return source


def describe_dataset(name: str, *, image_size: int | None = None) -> DatasetSpec:
    """Return channels, image size and class count of a known dataset.

    Parameters
    ----------
    name : str
        One of ``"digits"``, ``"mnist"``, ``"fashion_mnist"``, ``"cifar10"``.
    image_size : int | None, optional
        Size the images are resized to (see :func:`load_client_data`);
        None keeps the native size.

    Returns
    -------
    DatasetSpec
        The dataset's shape information.

    Raises
    ------
    ValueError
        If ``name`` is not a known dataset; the message lists the known ones.
    """
    spec = _dataset_source(name).spec
    return spec if image_size is None else replace(spec, image_size=_check_size(image_size))


def _check_size(image_size: int) -> int:
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"image_size must be a positive int, got {image_size!r}")
    return image_size


def resize_images(data: TensorDataset, image_size: int | None) -> TensorDataset:
    """Bilinearly resize the images of ``data`` to ``image_size`` (None: unchanged).

    Lets the small embedded digits stand in for larger inputs (e.g. 32x32 for
    a ResNet benchmark) without any download.
    """
    images, labels = data.tensors
    if image_size is None or images.shape[-1] == image_size == images.shape[-2]:
        return data
    resized = torch.nn.functional.interpolate(
        images, size=(_check_size(image_size),) * 2, mode="bilinear", align_corners=False
    )
    return TensorDataset(resized, labels)


def load_client_data(
    *,
    dataset: str,
    partition_id: int,
    num_partitions: int,
    partitioner: str,
    seed: int,
    alpha: float = 0.5,
    shards_per_partition: int = 2,
    path: str | None = None,
    test_fraction: float = 0.2,
    image_size: int | None = None,
    samples_per_client: int = 64,
    skew: float = 0.0,
) -> TensorDataset:
    """Load one client's partition of the training data.

    Every call rebuilds the (seeded) split and partitioning, so all clients
    agree on the partitioning without sharing state.

    Parameters
    ----------
    dataset : str
        Known dataset name (see :func:`describe_dataset`).
    partition_id : int
        This client's partition, in ``0 .. num_partitions - 1``.
    num_partitions : int
        Total number of clients.
    partitioner : str
        ``"iid"``, ``"dirichlet"`` or ``"shards"`` (see
        :func:`splitlearn.data.partition.make_partitioner`).
    seed : int
        Seeds the digits train/test split, the shuffling of Hub/local data and
        the partitioner.
    alpha : float, optional
        Dirichlet concentration (``"dirichlet"`` only).
    shards_per_partition : int, optional
        Shards per client (``"shards"`` only).
    path : str | None, optional
        Local folder to read instead of the Hub (format in the module
        docstring). Ignored for ``"digits"``.
    test_fraction : float, optional
        Held-out fraction of the digits data; ignored for other datasets,
        which have their own test split.
    image_size : int | None, optional
        Resize images to this size (bilinear); None keeps the native size.
    samples_per_client, skew : optional
        ``"synthetic"`` only: examples per device and how far devices' inputs differ.

    Returns
    -------
    TensorDataset
        ``(images, labels)``: float32 (n, C, H, W) in [0, 1] and int64 (n,).

    Raises
    ------
    ValueError
        For an unknown dataset or partitioner, bad partitioner arguments or an
        out-of-range ``partition_id``.
    """
    source = _dataset_source(dataset)
    if dataset == "synthetic":
        check_partition_id(partition_id, num_partitions)
        data = synthetic_partition(seed=seed, partition_id=partition_id,
                                   samples=samples_per_client, skew=skew)
        return resize_images(data, image_size)
    part = make_partitioner(
        partitioner,
        num_partitions=num_partitions,
        seed=seed,
        alpha=alpha,
        shards_per_partition=shards_per_partition,
        partition_by=source.label_key,
    )
    rows = _load_partition(
        source,
        part,
        partition_id=partition_id,
        num_partitions=num_partitions,
        path=path,
        seed=seed,
        test_fraction=test_fraction,
    )
    data = to_tensor_dataset(
        rows, image_key=source.image_key, label_key=source.label_key, spec=source.spec
    )
    return resize_images(data, image_size)


def load_test_data(
    *,
    dataset: str,
    seed: int,
    path: str | None = None,
    test_fraction: float = 0.2,
    image_size: int | None = None,
    skew: float = 0.0,
) -> TensorDataset:
    """Load the central (server-side) test set.

    Parameters
    ----------
    dataset : str
        Known dataset name (see :func:`describe_dataset`).
    seed : int
        Seed of the digits train/test split; must match the clients' seed so
        that test and training data do not overlap. Unused for other datasets.
    path : str | None, optional
        Local folder to read instead of the Hub (format in the module
        docstring). Ignored for ``"digits"``.
    test_fraction : float, optional
        Held-out fraction of the digits data; ignored for other datasets.
    image_size : int | None, optional
        Resize images to this size (bilinear); None keeps the native size.
    skew : float, optional
        ``"synthetic"`` only: how far the test devices' inputs differ.

    Returns
    -------
    TensorDataset
        ``(images, labels)``: float32 (n, C, H, W) in [0, 1] and int64 (n,).

    Raises
    ------
    ValueError
        For an unknown dataset name.
    """
    source = _dataset_source(dataset)
    if dataset == "synthetic":
        return resize_images(synthetic_test(seed=seed, skew=skew), image_size)
    if source.hub_id is None:
        _, test = load_digits_splits(test_fraction=test_fraction, seed=seed)
    else:
        from flwr_datasets import FederatedDataset

        # The order of the test set does not matter, so skip the shuffle.
        fds = FederatedDataset(
            dataset=path or source.hub_id, partitioners={"train": 1}, shuffle=False
        )
        test = fds.load_split("test")
    data = to_tensor_dataset(
        test, image_key=source.image_key, label_key=source.label_key, spec=source.spec
    )
    return resize_images(data, image_size)


def _load_partition(
    source: _DatasetSource,
    partitioner: Partitioner,
    *,
    partition_id: int,
    num_partitions: int,
    path: str | None,
    seed: int,
    test_fraction: float,
) -> datasets.Dataset:
    """Return the rows of one partition of the training split of ``source``."""
    if source.hub_id is None:
        train, _ = load_digits_splits(test_fraction=test_fraction, seed=seed)
        return partition_dataset(train, partitioner, partition_id)
    # Checked up front: a bad id would otherwise only fail after the download.
    check_partition_id(partition_id, num_partitions)
    from flwr_datasets import FederatedDataset

    fds = FederatedDataset(
        dataset=path or source.hub_id,
        partitioners={"train": partitioner},
        shuffle=True,
        seed=seed,
    )
    return fds.load_partition(partition_id)


def to_tensor_dataset(
    ds: datasets.Dataset, *, image_key: str, label_key: str, spec: DatasetSpec
) -> TensorDataset:
    """Convert a HuggingFace dataset of images and labels to tensors.

    Parameters
    ----------
    ds : datasets.Dataset
        Rows with an image column (PIL images, or nested lists/arrays shaped
        (H, W), (H, W, C), (C, H, W) or flat C*H*W) and an integer label column.
    image_key : str
        Name of the image column.
    label_key : str
        Name of the label column.
    spec : DatasetSpec
        Expected channels and image size.

    Returns
    -------
    TensorDataset
        ``(images, labels)``: float32 (N, C, H, W) and int64 (N,). Integer pixel
        values (e.g. decoded PIL images) are divided by 255; floating point
        pixels are assumed to be in [0, 1] already and kept as they are.

    Raises
    ------
    ValueError
        If the images cannot be brought to shape (C, H, W) of ``spec``.
    """
    shape = (spec.in_channels, spec.image_size, spec.image_size)
    if ds.num_rows == 0:
        return TensorDataset(
            torch.empty((0, *shape), dtype=torch.float32),
            torch.empty((0,), dtype=torch.int64),
        )
    # The numpy format decodes PIL images and stacks all rows in one go.
    columns = ds.select_columns([image_key, label_key]).with_format("numpy")[:]
    images = _to_nchw(np.asarray(columns[image_key]), shape)
    labels = np.asarray(columns[label_key]).astype(np.int64)
    return TensorDataset(torch.from_numpy(images), torch.from_numpy(labels))


def _to_nchw(images: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
    """Bring a stacked image array to float32 (N, C, H, W) in [0, 1]."""
    channels, height, width = shape
    scaled = _scale_to_unit(images)
    num = scaled.shape[0]
    if scaled.shape[1:] == shape:
        return scaled
    if scaled.shape[1:] == (height, width, channels):
        return np.ascontiguousarray(scaled.transpose(0, 3, 1, 2))
    if channels == 1 and scaled.shape[1:] == (height, width):
        return scaled[:, np.newaxis]
    if scaled.shape[1:] == (channels * height * width,):
        return scaled.reshape(num, *shape)
    raise ValueError(f"cannot convert images of shape {images.shape[1:]} to (C, H, W) = {shape}")


def _scale_to_unit(images: np.ndarray) -> np.ndarray:
    """Map integer pixels (0..255) to [0, 1]; keep float pixels as float32."""
    if images.dtype == object:
        raise ValueError("images have different shapes or modes and cannot be stacked")
    if np.issubdtype(images.dtype, np.integer):
        return images.astype(np.float32) / np.float32(255.0)
    return images.astype(np.float32, copy=False)


def client_dataset(
    dataset: DatasetConfig, partitioner: PartitionerConfig, *, seed: int, partition_id: int,
    num_partitions: int,
) -> TensorDataset:
    """Load one client's training partition as the config groups describe it."""
    return load_client_data(
        dataset=dataset.name, partition_id=partition_id, num_partitions=num_partitions,
        partitioner=partitioner.name, seed=seed, alpha=partitioner.alpha,
        shards_per_partition=partitioner.shards_per_partition, path=dataset.path,
        test_fraction=dataset.test_fraction, image_size=dataset.image_size,
        samples_per_client=dataset.samples_per_client, skew=dataset.skew,
    )


def local_dataset(path: str | Path, dataset: DatasetConfig) -> TensorDataset:
    """Load a device's own training data: a parquet file, or a folder of them.

    The rows hold the run's dataset columns (``image`` and ``label``; ``img``
    and ``label`` for CIFAR-10) at the dataset's native size: images as a
    ``datasets.Image()`` feature, nested lists or arrays (integer pixels 0..255,
    or floats in [0, 1]), labels as integers below the number of classes.
    ``Dataset.to_parquet`` writes such a file. The images are resized to
    ``dataset.image_size`` as the run's own data is.

    Raises
    ------
    ValueError
        If there is no parquet file, a column is missing, or a label is out of range.
    """
    source = _dataset_source(dataset.name)
    root = Path(path)
    files = sorted(root.glob("*.parquet")) if root.is_dir() else [root]
    if not files or not files[0].is_file():
        raise ValueError(f"no parquet file at {root}")
    import datasets
    import pyarrow.parquet

    # Read with pyarrow and wrap: nothing is written to a datasets cache on the device.
    table = pyarrow.concat_tables([pyarrow.parquet.read_table(f) for f in files])
    rows = datasets.Dataset(table)
    missing = sorted({source.image_key, source.label_key} - set(rows.column_names))
    if missing:
        raise ValueError(f"{root} has columns {rows.column_names}; {dataset.name} needs "
                         f"{missing} as well")
    data = to_tensor_dataset(rows, image_key=source.image_key, label_key=source.label_key,
                             spec=source.spec)
    labels = data.tensors[1]
    if labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < source.spec.num_classes:
        raise ValueError(f"labels in {root} span {int(labels.min())}..{int(labels.max())}; "
                         f"{dataset.name} has classes 0..{source.spec.num_classes - 1}")
    return resize_images(data, dataset.image_size)


def held_out_dataset(dataset: DatasetConfig, *, seed: int) -> TensorDataset:
    """Load the held-out test split as the ``dataset`` config group describes it."""
    return load_test_data(
        dataset=dataset.name, seed=seed, path=dataset.path,
        test_fraction=dataset.test_fraction, image_size=dataset.image_size, skew=dataset.skew,
    )


def check_dataset_config(dataset: DatasetConfig) -> None:
    """Refuse a dataset config that could only fail later (after engines started).

    Raises
    ------
    ValueError
        For an unknown name, a ``path`` given to digits (which ships with
        scikit-learn and would ignore it), or a ``path`` that is not a folder
        holding data files.
    """
    source = _dataset_source(dataset.name)
    if dataset.path is None:
        return
    if source.hub_id is None:
        raise ValueError(
            f"dataset.path={dataset.path!r} is set but dataset.name={dataset.name!r} is built in "
            "and reads no folder; drop dataset.path or choose "
            f"{[n for n in KNOWN_DATASETS if _KNOWN_DATASETS[n].hub_id]}"
        )
    folder = Path(dataset.path)
    if not folder.is_dir() or not any(p.is_file() for p in folder.rglob("*")):
        raise ValueError(
            f"dataset.path={dataset.path!r} is not a folder holding the dataset's files "
            "(e.g. train*.parquet and test*.parquet)"
        )
