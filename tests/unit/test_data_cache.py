"""A device's data cache: the same tensors back, built once, rebuilt when anything changes."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import TensorDataset

from splitlearn.config import DatasetConfig, PartitionerConfig
from splitlearn.data import client_dataset
from splitlearn.data.cache import ProcessData, cached_dataset


class Builds:
    """Counts how often the data had to be built."""

    def __init__(self, data: TensorDataset) -> None:
        self.data, self.count = data, 0

    def __call__(self) -> TensorDataset:
        self.count += 1
        return self.data


def digits_partition(partition_id: int) -> TensorDataset:
    return client_dataset(DatasetConfig(), PartitionerConfig(), seed=0,
                          partition_id=partition_id, num_partitions=10)


def same(a: TensorDataset, b: TensorDataset) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors, strict=True))


def test_a_partition_is_built_once_and_read_back_the_same(tmp_path):
    build = Builds(digits_partition(3))
    key = {"dataset": "digits", "partition_id": 3}
    first = cached_dataset(tmp_path, key, build)
    again = cached_dataset(tmp_path, key, build)
    assert build.count == 1
    assert same(first, build.data) and same(again, build.data)
    assert again.tensors[0].dtype == torch.float32 and again.tensors[1].dtype == torch.int64


def test_another_key_is_other_data(tmp_path):
    three, four = Builds(digits_partition(3)), Builds(digits_partition(4))
    cached_dataset(tmp_path, {"partition_id": 3}, three)
    assert same(cached_dataset(tmp_path, {"partition_id": 4}, four), four.data)
    assert (three.count, four.count) == (1, 1)
    assert len(list(tmp_path.glob("data-*.pt"))) == 2


def test_an_unreadable_file_is_rebuilt(tmp_path, caplog):
    build = Builds(digits_partition(0))
    cached_dataset(tmp_path, {"partition_id": 0}, build)
    [path] = tmp_path.glob("data-*.pt")
    path.write_bytes(b"not a tensor file")
    assert same(cached_dataset(tmp_path, {"partition_id": 0}, build), build.data)
    assert build.count == 2 and "unreadable" in caplog.text
    assert same(cached_dataset(tmp_path, {"partition_id": 0}, build), build.data)
    assert build.count == 2  # the rebuilt file is good


def test_a_changed_local_file_is_read_afresh(tmp_path):
    own = tmp_path / "own.parquet"
    own.write_bytes(b"first")
    build = Builds(digits_partition(1))
    key = {"path": str(own)}
    cached_dataset(tmp_path / "cache", key, build)
    cached_dataset(tmp_path / "cache", key, build)
    assert build.count == 1
    own.write_bytes(b"second, longer")
    cached_dataset(tmp_path / "cache", key, build)
    assert build.count == 2


def test_a_failing_load_leaves_no_file(tmp_path):
    def broken() -> TensorDataset:
        raise ValueError("no parquet file")

    with pytest.raises(ValueError, match="no parquet"):
        cached_dataset(tmp_path, {"partition_id": 0}, broken)
    assert os.listdir(tmp_path) == []


def nbytes(data: TensorDataset) -> int:
    return sum(t.nbytes for t in data.tensors)


def test_a_process_keeps_a_partition_and_hands_out_copies():
    kept = ProcessData(max_bytes=2**20)
    build = Builds(digits_partition(3))
    key = {"dataset": "digits", "partition_id": 3}
    first = kept.get(key, build)
    first.tensors[0].fill_(7.0)  # a round that changed its copy
    again = kept.get(dict(reversed(key.items())), build)  # the same key in another order
    assert build.count == 1 and same(again, build.data)
    assert kept.get({"dataset": "digits", "partition_id": 4}, Builds(digits_partition(4)))
    assert len(kept) == 2 and kept.bytes == nbytes(build.data) + nbytes(digits_partition(4))


def test_the_least_recently_used_partition_leaves_first_and_the_bound_holds():
    parts = {i: Builds(digits_partition(i)) for i in range(3)}
    size = nbytes(parts[0].data)
    kept = ProcessData(max_bytes=2 * size + size // 2)  # room for two partitions
    for i in (0, 1, 0, 2):  # 1 is then the least recently used
        kept.get({"partition_id": i}, parts[i])
    assert kept.bytes <= kept.max_bytes and len(kept) == 2
    kept.get({"partition_id": 0}, parts[0])
    kept.get({"partition_id": 1}, parts[1])
    assert [parts[i].count for i in range(3)] == [1, 2, 1]


def test_data_larger_than_the_bound_is_built_every_time():
    build = Builds(digits_partition(0))
    kept = ProcessData(max_bytes=nbytes(build.data) - 1)
    for _ in range(2):
        assert kept.get({"partition_id": 0}, build) is build.data  # handed over, not copied
    assert build.count == 2 and len(kept) == 0 and kept.bytes == 0
