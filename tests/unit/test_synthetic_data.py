"""The synthetic federated dataset: each device's data from the seed and its id alone."""

from __future__ import annotations

import pytest
import torch

from protocols import check_config, compose_config
from splitlearn.config import DatasetConfig
from splitlearn.data import held_out_dataset, load_client_data
from splitlearn.data.synthetic import device_examples, synthetic_test


def client(partition_id: int, num_partitions: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    data = load_client_data(dataset="synthetic", partition_id=partition_id,
                            num_partitions=num_partitions, partitioner="iid", seed=3, **kw)
    return data.tensors


def test_a_devices_data_depends_on_the_seed_and_its_id_not_on_the_federation_size():
    x10, y10 = client(7, 10)
    x10k, y10k = client(7, 10_000)
    assert torch.equal(x10, x10k) and torch.equal(y10, y10k)
    other, _ = client(8, 10)
    assert not torch.equal(x10, other)
    assert x10.shape == (64, 1, 8, 8) and x10.dtype == torch.float32 and y10.dtype == torch.int64
    assert 0 < float(x10.min()) and float(x10.max()) < 1
    x, _ = client(7, 10, samples_per_client=5, image_size=16)
    assert x.shape == (5, 1, 16, 16)
    with pytest.raises(ValueError, match="partition"):
        client(10, 10)


def test_labels_are_balanced_without_skew_and_skew_moves_each_devices_inputs():
    _, labels = device_examples(seed=0, device=1, samples=5000, skew=0.0)
    counts = torch.bincount(torch.from_numpy(labels), minlength=10)
    assert int(counts.min()) > 400  # uniform labels: 500 expected per class

    def spread_of_device_means(skew: float) -> float:
        means = torch.stack([torch.from_numpy(device_examples(
            seed=0, device=d, samples=200, skew=skew)[0]).mean(0).flatten() for d in range(8)])
        return float(means.std(0).mean())

    assert spread_of_device_means(1.0) > 5 * spread_of_device_means(0.0)


def test_the_test_set_is_the_same_for_every_federation_and_no_clients_data():
    test = held_out_dataset(DatasetConfig(name="synthetic"), seed=3)
    assert torch.equal(test.tensors[0], synthetic_test(seed=3, skew=0.0).tensors[0])
    assert len(test) == 1000
    smaller = held_out_dataset(DatasetConfig(name="synthetic", samples_per_client=5), seed=3)
    assert torch.equal(smaller.tensors[0], test.tensors[0])  # clients' shares do not change it
    # No held-out image is any client's training image (row by row, the first 10 clients).
    train = torch.cat([client(k, 10)[0] for k in range(10)]).flatten(1)
    assert float(torch.cdist(test.tensors[0].flatten(1), train).min()) > 0


def test_the_labels_follow_the_images():
    """A linear probe fits the data: a generator whose labels ignore the images would not."""
    parts = [client(k, 10) for k in range(10)]
    x = torch.cat([p[0] for p in parts]).flatten(1)
    y = torch.cat([p[1] for p in parts])
    test = synthetic_test(seed=3, skew=0.0)
    probe = torch.nn.Linear(64, 10)
    optimiser = torch.optim.SGD(probe.parameters(), lr=0.5)
    for _ in range(200):
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(probe(x), y).backward()
        optimiser.step()
    accuracy = (probe(test.tensors[0].flatten(1)).argmax(1) == test.tensors[1]).float().mean()
    assert float(accuracy) > 0.8


@pytest.mark.parametrize(("overrides", "message"), [
    (("dataset.samples_per_client=0",), "dataset.samples_per_client=0: need at least 1"),
    (("dataset.skew=-1",), "dataset.skew=-1.0: need at least 0"),
    (("partitioner=dirichlet",), "partitioner=dirichlet does not apply to dataset=synthetic"),
    (("dataset.path=/tmp",), "dataset.path='/tmp' is set but dataset.name='synthetic'"),
])
def test_bad_synthetic_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_config(compose_config(["dataset=synthetic", "logger=none", *overrides]))
