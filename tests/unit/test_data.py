"""Unit tests for splitlearn.data: digits split, partitioners and loaders."""

from __future__ import annotations

import socket
from collections import Counter
from pathlib import Path

import datasets
import flwr_datasets.common.telemetry as flwr_telemetry
import numpy as np
import pytest
import torch
from PIL import Image

from splitlearn.data import (
    DatasetSpec,
    describe_dataset,
    load_client_data,
    load_digits_splits,
    load_test_data,
    make_partitioner,
    partition_dataset,
    to_tensor_dataset,
)

NUM_DIGITS = 1797
NUM_CLASSES = 10


# --------------------------------------------------------------------------- helpers
def _labels(ds: datasets.Dataset) -> np.ndarray:
    return np.asarray(ds["label"])


def _indexed_digits_train(seed: int = 0) -> datasets.Dataset:
    """Digits train split with a row id column, to check disjointness."""
    train, _ = load_digits_splits(seed=seed)
    return train.add_column("row_id", list(range(train.num_rows)))


def _all_partitions(
    name: str, train: datasets.Dataset, *, num_partitions: int, seed: int, **kwargs
) -> list[datasets.Dataset]:
    partitioner = make_partitioner(name, num_partitions=num_partitions, seed=seed, **kwargs)
    return [partition_dataset(train, partitioner, i) for i in range(num_partitions)]


def _mean_max_class_share(partitions: list[datasets.Dataset]) -> float:
    shares = [Counter(_labels(p).tolist()).most_common(1)[0][1] / p.num_rows for p in partitions]
    return float(np.mean(shares))


# --------------------------------------------------------------------------- fixtures
@pytest.fixture
def offline_hf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Keep HuggingFace caches in tmp_path and make any network use fail."""
    cache = tmp_path / "hf_cache"
    monkeypatch.setenv("HF_HOME", str(cache))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache / "datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # datasets and flwr-datasets read these at import time, so patch the
    # module attributes too (they are looked up again on every call).
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(flwr_telemetry, "FLWR_TELEMETRY_ENABLED", "0")

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network access attempted in an offline test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def _write_splits(folder: Path, rows: dict[str, datasets.Dataset]) -> str:
    """Write each split as <split>.parquet, the layout load_client_data reads."""
    folder.mkdir()
    for split, ds in rows.items():
        ds.to_parquet(str(folder / f"{split}.parquet"))
    return str(folder)


def _grey_images(labels: list[int]) -> datasets.Dataset:
    """MNIST-like rows whose pixel value encodes the label (label * 20)."""
    images = [Image.fromarray(np.full((28, 28), 20 * y, dtype=np.uint8)) for y in labels]
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)}
    )
    return datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)


def _rgb_images(labels: list[int]) -> datasets.Dataset:
    """CIFAR-like rows: red encodes the label, green 0, blue 255."""
    pixels = [np.zeros((32, 32, 3), dtype=np.uint8) for _ in labels]
    for pixel, label in zip(pixels, labels, strict=True):
        pixel[..., 0], pixel[..., 2] = 20 * label, 255
    features = datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)}
    )
    return datasets.Dataset.from_dict(
        {"img": [Image.fromarray(p) for p in pixels], "label": labels},
        features=features,
    )


@pytest.fixture
def mnist_like(tmp_path: Path, offline_hf: None) -> str:
    """Folder with 40 train and 10 test MNIST-like rows."""
    return _write_splits(
        tmp_path / "mnist_like",
        {
            "train": _grey_images([i % 10 for i in range(40)]),
            "test": _grey_images(list(range(10))),
        },
    )


@pytest.fixture
def cifar_like(tmp_path: Path, offline_hf: None) -> str:
    """Folder with 20 train and 10 test CIFAR-like rows."""
    return _write_splits(
        tmp_path / "cifar_like",
        {
            "train": _rgb_images([i % 10 for i in range(20)]),
            "test": _rgb_images(list(range(10))),
        },
    )


# --------------------------------------------------------------------------- digits
def test_digits_split_sizes_and_range() -> None:
    """Train and test add up to 1797 rows and pixels lie in [0, 1]."""
    train, test = load_digits_splits(test_fraction=0.2, seed=0)
    assert train.num_rows + test.num_rows == NUM_DIGITS
    assert test.num_rows == pytest.approx(0.2 * NUM_DIGITS, abs=1)
    images = np.asarray(train.with_format("numpy")["image"])
    assert images.shape[1:] == (8, 8)
    assert images.min() >= 0.0 and images.max() <= 1.0


def test_digits_split_is_stratified() -> None:
    """Every class is in the test split in its overall proportion."""
    train, test = load_digits_splits(seed=0)
    train_counts = Counter(_labels(train).tolist())
    test_counts = Counter(_labels(test).tolist())
    assert set(test_counts) == set(range(NUM_CLASSES))
    for label, count in test_counts.items():
        total = count + train_counts[label]
        assert count == pytest.approx(0.2 * total, abs=1)


def test_digits_split_depends_only_on_seed() -> None:
    """The same seed gives the same split, another seed another one."""
    first_train, first_test = load_digits_splits(seed=3)
    again_train, again_test = load_digits_splits(seed=3)
    other_train, _ = load_digits_splits(seed=4)
    np.testing.assert_array_equal(first_train["image"][:], again_train["image"][:])
    np.testing.assert_array_equal(_labels(first_test), _labels(again_test))
    assert not np.array_equal(first_train["image"][:], other_train["image"][:])


# --------------------------------------------------------------------------- partition
def test_iid_partitions_are_balanced_disjoint_and_complete() -> None:
    """IID partitions differ in size by at most 1 and cover the data once."""
    train = _indexed_digits_train()
    parts = _all_partitions("iid", train, num_partitions=10, seed=0)
    sizes = [p.num_rows for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == train.num_rows
    row_ids = [i for p in parts for i in p["row_id"]]
    assert len(set(row_ids)) == len(row_ids) == train.num_rows


def test_dirichlet_partitions_are_skewed_and_non_empty() -> None:
    """Dirichlet(0.5) partitions are non-empty, disjoint and label-skewed."""
    train = _indexed_digits_train()
    parts = _all_partitions("dirichlet", train, num_partitions=10, seed=0, alpha=0.5)
    iid = _all_partitions("iid", train, num_partitions=10, seed=0)
    assert all(p.num_rows > 0 for p in parts)
    row_ids = [i for p in parts for i in p["row_id"]]
    assert len(set(row_ids)) == len(row_ids)
    assert _mean_max_class_share(parts) > 0.3
    assert _mean_max_class_share(parts) > _mean_max_class_share(iid) + 0.1


def test_dirichlet_is_deterministic_for_a_seed() -> None:
    """Dirichlet partitioning is reproducible from its seed alone."""
    train = _indexed_digits_train()
    first = _all_partitions("dirichlet", train, num_partitions=10, seed=7)
    again = _all_partitions("dirichlet", train, num_partitions=10, seed=7)
    other = _all_partitions("dirichlet", train, num_partitions=10, seed=8)
    assert [p["row_id"] for p in first] == [p["row_id"] for p in again]
    assert [p["row_id"] for p in first] != [p["row_id"] for p in other]


def test_dirichlet_handles_many_clients_on_small_data() -> None:
    """100 Dirichlet clients on 1437 digits rows all get data."""
    train = _indexed_digits_train()
    parts = _all_partitions("dirichlet", train, num_partitions=100, seed=0)
    assert all(p.num_rows >= 1 for p in parts)


def test_shard_partitions_hold_few_labels() -> None:
    """Shard partitions see only a few labels each."""
    train = _indexed_digits_train()
    shards = 2
    parts = _all_partitions("shards", train, num_partitions=10, seed=0, shards_per_partition=shards)
    label_counts = [len(set(p["label"])) for p in parts]
    # A shard may straddle a class boundary of the label-sorted data, so a
    # partition can see up to 2 labels per shard; on average far fewer.
    assert max(label_counts) <= 2 * shards
    assert np.mean(label_counts) <= shards + 1


def test_partition_dataset_rejects_out_of_range_id() -> None:
    """Partition ids outside 0..n-1 raise ValueError."""
    train, _ = load_digits_splits(seed=0)
    partitioner = make_partitioner("dirichlet", num_partitions=5, seed=0)
    with pytest.raises(ValueError, match="partition_id"):
        partition_dataset(train, partitioner, 5)
    with pytest.raises(ValueError, match="partition_id"):
        partition_dataset(train, partitioner, -1)


def test_partition_dataset_rejects_another_dataset() -> None:
    """A partitioner is reused for its data but refuses other data."""
    train, test = load_digits_splits(seed=0)
    partitioner = make_partitioner("iid", num_partitions=5, seed=0)
    partition_dataset(train, partitioner, 0)
    assert partition_dataset(train, partitioner, 1).num_rows > 0
    with pytest.raises(ValueError, match="rows"):
        partition_dataset(test, partitioner, 0)


# --------------------------------------------------------------------------- errors
def test_unknown_partitioner_lists_accepted_names() -> None:
    """An unknown partitioner name is reported with the accepted names."""
    with pytest.raises(ValueError, match="'pathological'.*iid, dirichlet, shards"):
        make_partitioner("pathological", num_partitions=2, seed=0)


@pytest.mark.parametrize("alpha", [0.0, -1.0])
def test_dirichlet_rejects_non_positive_alpha(alpha: float) -> None:
    """Dirichlet alpha must be strictly positive."""
    with pytest.raises(ValueError, match="alpha"):
        make_partitioner("dirichlet", num_partitions=2, seed=0, alpha=alpha)


def test_unknown_dataset_lists_known_names() -> None:
    """An unknown dataset name is reported with the known names."""
    with pytest.raises(ValueError, match="'svhn'.*digits.*mnist.*cifar10"):
        describe_dataset("svhn")
    with pytest.raises(ValueError, match="known datasets"):
        load_client_data(
            dataset="svhn",
            partition_id=0,
            num_partitions=2,
            partitioner="iid",
            seed=0,
        )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("digits", (1, 8, 10)),
        ("mnist", (1, 28, 10)),
        ("fashion_mnist", (1, 28, 10)),
        ("cifar10", (3, 32, 10)),
    ],
)
def test_describe_dataset(name: str, expected: tuple[int, int, int]) -> None:
    """Known datasets report their channels, size and classes."""
    spec = describe_dataset(name)
    assert spec.name == name
    assert (spec.in_channels, spec.image_size, spec.num_classes) == expected


# --------------------------------------------------------------------------- loaders
def _assert_tensor_dataset(
    data: torch.utils.data.TensorDataset, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = data.tensors
    assert tuple(images.shape[1:]) == shape
    assert images.dtype == torch.float32 and labels.dtype == torch.int64
    assert labels.shape == (images.shape[0],)
    assert 0.0 <= float(images.min()) and float(images.max()) <= 1.0
    return images, labels


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet", "shards"])
def test_load_client_data_digits(partitioner: str) -> None:
    """Digits client data is a float32 (n, 1, 8, 8) / int64 TensorDataset."""
    data = load_client_data(
        dataset="digits",
        partition_id=3,
        num_partitions=10,
        partitioner=partitioner,
        seed=0,
    )
    images, _ = _assert_tensor_dataset(data, (1, 8, 8))
    assert images.shape[0] > 0


def test_load_test_data_digits_matches_split() -> None:
    """Digits test data is the held-out part of the seeded split."""
    _, test = load_digits_splits(seed=1)
    data = load_test_data(dataset="digits", seed=1)
    _, labels = _assert_tensor_dataset(data, (1, 8, 8))
    np.testing.assert_array_equal(labels.numpy(), _labels(test))


def test_load_client_data_from_local_mnist_folder(mnist_like: str) -> None:
    """IID partitions of a local MNIST-like folder are complete and aligned."""
    parts = [
        load_client_data(
            dataset="mnist",
            partition_id=i,
            num_partitions=4,
            partitioner="iid",
            seed=0,
            path=mnist_like,
        )
        for i in range(4)
    ]
    all_labels: list[int] = []
    for part in parts:
        images, labels = _assert_tensor_dataset(part, (1, 28, 28))
        assert images.shape[0] == 10
        # Pixels encode the label, so this checks rows stayed aligned.
        expected = (20 * labels).float() / 255
        torch.testing.assert_close(images.mean(dim=(1, 2, 3)), expected)
        all_labels += labels.tolist()
    assert Counter(all_labels) == Counter(i % 10 for i in range(40))


def test_load_test_data_from_local_mnist_folder(mnist_like: str) -> None:
    """The test split of a local MNIST-like folder loads as tensors."""
    data = load_test_data(dataset="mnist", seed=0, path=mnist_like)
    images, labels = _assert_tensor_dataset(data, (1, 28, 28))
    assert labels.tolist() == list(range(10))
    torch.testing.assert_close(images[:, 0, 0, 0], (20 * labels).float() / 255)


def test_local_cifar_folder_gives_channels_first(cifar_like: str) -> None:
    """CIFAR-like RGB images (column 'img') come out channels-first."""
    train = load_client_data(
        dataset="cifar10",
        partition_id=1,
        num_partitions=2,
        partitioner="iid",
        seed=0,
        path=cifar_like,
    )
    test = load_test_data(dataset="cifar10", seed=0, path=cifar_like)
    for data in (train, test):
        images, labels = _assert_tensor_dataset(data, (3, 32, 32))
        torch.testing.assert_close(images[:, 0, 5, 5], (20 * labels).float() / 255)
        assert torch.all(images[:, 1] == 0) and torch.all(images[:, 2] == 1)
    assert train.tensors[0].shape[0] == 10
    assert test.tensors[0].shape[0] == 10


def test_local_folder_rejects_bad_partition_id(mnist_like: str) -> None:
    """A bad partition id fails before any data is loaded."""
    with pytest.raises(ValueError, match="partition_id"):
        load_client_data(
            dataset="mnist",
            partition_id=4,
            num_partitions=4,
            partitioner="iid",
            seed=0,
            path=mnist_like,
        )


def test_to_tensor_dataset_accepts_flat_rows_and_rejects_bad_shapes() -> None:
    """Flat rows are reshaped; rows of the wrong size raise ValueError."""
    spec = DatasetSpec("flat", in_channels=1, image_size=2, num_classes=2)
    flat = datasets.Dataset.from_dict({"x": [[0.0, 0.5, 1.0, 0.25]], "y": [1]})
    images, labels = to_tensor_dataset(flat, image_key="x", label_key="y", spec=spec).tensors
    assert images.shape == (1, 1, 2, 2) and labels.tolist() == [1]
    bad = datasets.Dataset.from_dict({"x": [[0.0, 0.5, 1.0]], "y": [1]})
    with pytest.raises(ValueError, match="cannot convert"):
        to_tensor_dataset(bad, image_key="x", label_key="y", spec=spec)
