"""The client step exported to ExecuTorch trains as eager PyTorch does, against a real trunk.

The reference is the eager split client (``SplitStep``) on the same batches against a
trunk of its own: after several steps both clients' weights and both trunks agree.
``lenet5``'s bottom ends in MaxPool2d, whose backward ExecuTorch's portable kernel got
wrong (see :mod:`clients.executorch_program`). The ClientApp's rounds borrow their programs from
the process's cache: round 2 reuses round 1's with the weights it received, and rounds running
at once borrow programs of their own.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from clients.executorch_program import (
    PROGRAMS,
    ExecuTorchBottom,
    ExecuTorchClientStep,
    ProgramCache,
    ProgramKey,
    architecture,
    export_client_step,
)
from experiments.local import run_local
from server.app import TrainingResult
from splitlearn.models import SplittableModel
from splitlearn.stages import split
from tests.conftest import digits_like_model, fixed_batches, small_config
from tests.helpers import max_param_diff, train_split_client
from tests.integration.test_simulation import read_clients

LR = 0.1
STEPS = 8
BATCH = 16
TOLERANCE = 1e-5


@pytest.mark.parametrize("name", ["cnn", "lenet5"])
def test_executorch_client_trains_as_eager_pytorch(trunk_server_factory, name):
    reference = digits_like_model(name)
    batches = fixed_batches(STEPS, batch=BATCH)
    eager_server = trunk_server_factory(reference, lr=LR)
    eager_client = copy.deepcopy(reference)
    channel = eager_server.channel(eager_server.token(1))
    train_split_client(eager_client, 1, batches, channel, lr=LR)
    channel.close()

    et_server = trunk_server_factory(reference, lr=LR)
    device = ExecuTorchClientStep(export_client_step(reference, 1, batch_size=BATCH), lr=LR)
    channel = et_server.channel(et_server.token(1))
    for x, y in batches:
        gradient, _, _ = channel.forward(device.activations(x), y)
        device.train(x, gradient)
    channel.close()

    bottom, _ = split(eager_client, 1)
    mine = device.state_dict()
    for key, value in bottom.state_dict().items():
        assert (mine[key].reshape(value.shape) - value).abs().max() <= TOLERANCE, key
    assert max_param_diff(et_server.model, eager_server.model) <= TOLERANCE


def test_the_program_refuses_a_batch_of_another_shape():
    reference = digits_like_model("cnn")
    device = ExecuTorchClientStep(export_client_step(reference, 1, batch_size=BATCH), lr=LR)
    with pytest.raises(ValueError, match=r"batches of shape \(16, 1, 8, 8\), got \(4, 1, 8, 8\)"):
        device.activations(torch.zeros(4, 1, 8, 8))


# --- programs kept across rounds (ExecuTorchBottom and its cache) -------------------------------

#: SGD with momentum and weight decay: an SGD state or weights carried over would show.
SGD = {"lr": LR, "momentum": 0.5, "weight_decay": 0.001}
#: Batch sizes of a round: two programs (16 and the smaller last batch).
ROUND_BATCHES = (16, 16, 8)


def round_data(model: SplittableModel, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Return a round's batches and the trunk's gradients for them (fixed tensors)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(n, *model.input_shape, generator=g),
             torch.randn(n, *model.cut_shape(1), generator=g)) for n in ROUND_BATCHES]


def eager_round(model: SplittableModel, data) -> dict[str, torch.Tensor]:
    """Return the bottom's weights after the round in eager PyTorch (a fresh SGD)."""
    bottom, _ = split(copy.deepcopy(model), 1)
    optimizer = torch.optim.SGD(bottom.parameters(), **SGD)
    for x, grad in data:
        optimizer.zero_grad()
        bottom(x).backward(grad)
        optimizer.step()
    return bottom.state_dict()


def assert_trained_as_eager(device: ExecuTorchBottom, model: SplittableModel, data) -> None:
    mine = device.state_dict()
    for key, value in eager_round(model, data).items():
        assert (mine[key].reshape(value.shape) - value).abs().max() <= TOLERANCE, key


def test_a_later_round_reuses_the_programs_with_its_own_weights_and_a_fresh_sgd():
    cache = ProgramCache()
    for seed in range(3):  # each round its own weights (same architecture) and batches
        model = digits_like_model("cnn", seed=seed)
        data = round_data(model, seed)
        device = ExecuTorchBottom(model, 1, **SGD, cache=cache)
        for x, grad in data:
            device.activations(x)
            device.train(x, grad)
        assert_trained_as_eager(device, model, data)
        device.release()
        assert cache.exports == 2 and len(cache) == 2  # round 1's two programs, reused
    assert device.state_dict() == {}  # given back: nothing of them stays with the round


def test_rounds_at_once_borrow_programs_of_their_own():
    cache = ProgramCache()
    models = [digits_like_model("cnn", seed=seed) for seed in (0, 1)]
    data = [round_data(m, seed) for seed, m in enumerate(models)]
    devices = [ExecuTorchBottom(m, 1, **SGD, cache=cache) for m in models]
    for batches in zip(*data, strict=True):  # interleaved: each program runs between the other's
        for device, (x, _) in zip(devices, batches, strict=True):
            device.activations(x)
        for device, (x, grad) in zip(devices, batches, strict=True):
            device.train(x, grad)
    for device, model, batches in zip(devices, models, data, strict=True):
        assert_trained_as_eager(device, model, batches)
        device.release()
    assert cache.exports == 4 and len(cache) == 4  # two programs for each of the two rounds


def test_models_of_another_architecture_never_get_the_program():
    cache = ProgramCache()
    cnn, lenet = digits_like_model("cnn"), digits_like_model("lenet5")
    device = ExecuTorchBottom(cnn, 1, **SGD, cache=cache)
    device.activations(torch.zeros(16, 1, 8, 8))
    device.release()
    data = round_data(lenet, 0)
    device = ExecuTorchBottom(lenet, 1, **SGD, cache=cache)
    for x, grad in data:
        device.train(x, grad)
    assert_trained_as_eager(device, lenet, data)
    device.release()
    assert cache.exports == 3 and len(cache) == 3  # lenet5 exported its own two, cnn's kept


def test_a_kept_program_whose_parameters_do_not_fit_is_exported_again():
    cache = ProgramCache()
    cnn, lenet = digits_like_model("cnn"), digits_like_model("lenet5")
    stray = ExecuTorchClientStep(export_client_step(cnn, 1, batch_size=16), lr=LR)
    stray.activations(torch.zeros(16, 1, 8, 8))
    # Kept under lenet5's key, as a key that missed a difference would keep it.
    cache.give_back(ProgramKey(architecture(lenet, 1), 1, (16, 1, 8, 8)), stray)
    data = round_data(lenet, 0)[:2]
    device = ExecuTorchBottom(lenet, 1, **SGD, cache=cache)
    for x, grad in data:
        device.train(x, grad)
    assert cache.exports == 1 and len(cache) == 0
    assert_trained_as_eager(device, lenet, data)


def test_the_cache_keeps_the_most_recently_given_back_programs():
    cnn = digits_like_model("cnn")
    program = ExecuTorchClientStep(export_client_step(cnn, 1, batch_size=16), lr=LR)
    keys = [ProgramKey(architecture(cnn, 1, f"run {i}"), 1, (16, 1, 8, 8)) for i in range(3)]
    cache = ProgramCache(capacity=2)
    for key in keys:
        cache.give_back(key, program)
    assert len(cache) == 2
    assert cache.lend(keys[2], lambda: program, fits=lambda _: True) is program
    assert cache.exports == 0
    cache.lend(keys[0], lambda: program, fits=lambda _: True)  # dropped first: exported
    assert cache.exports == 1 and len(cache) == 1


# --- the ClientApp path (devices.runtime=executorch) ----------------------------------------

#: One device, 40 examples in batches of 16 (the last one 8: a program of its own), two rounds
#: with momentum: the second round exports from the weights the first sent back.
CLIENTAPP_RUN = ("num_clients=1", "strategy.min_train_nodes=1",
                 "dataset=synthetic", "dataset.samples_per_client=40", "strategy.batch_size=16",
                 "model.cut=1", "strategy.momentum=0.5", "strategy.weight_decay=0.001")


def run_with_runtime(tmp_path: Path, name: str, runtime: str, *overrides: str,
                     concurrency: int = 1, strategy: str = "splitfed_v1",
                     ) -> tuple[TrainingResult, list[dict[str, str]]]:
    """Run ``CLIENTAPP_RUN`` through the real ClientApp; return the result and its rows."""
    run_dir = tmp_path / runtime
    cfg = small_config(f"model={name}", f"strategy={strategy}", *CLIENTAPP_RUN, *overrides,
                       f"devices.runtime={runtime}", run_dir=str(run_dir))
    return run_local(cfg, concurrency=concurrency), read_clients(run_dir)


@pytest.mark.parametrize(("name", "strategy"), [
    ("cnn", "splitfed_v1"), ("lenet5", "splitfed_v1"), ("cnn", "sglr"),
], ids=["cnn", "lenet5", "cnn-sglr"])
def test_the_clientapp_trains_through_executorch_as_it_does_eagerly(tmp_path, name, strategy):
    """SGLR's device side is the same step; its trunk averages the gradients it sends."""
    eager, eager_rows = run_with_runtime(tmp_path, name, "eager", strategy=strategy)
    PROGRAMS.clear()
    executorch, executorch_rows = run_with_runtime(tmp_path, name, "executorch",
                                                   strategy=strategy)

    assert PROGRAMS.exports == 2  # round 1's two batch shapes; round 2 reused them
    assert max_param_diff(executorch.model, eager.model) <= TOLERANCE
    for a, b in zip(executorch.history, eager.history, strict=True):
        assert a["test_loss"] == pytest.approx(b["test_loss"], abs=TOLERANCE)
    assert [r["status"] for r in executorch_rows] == ["ok", "ok"]
    for a, b in zip(executorch_rows, eager_rows, strict=True):
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), abs=TOLERANCE)
        for key in ("num_examples", "steps", "bytes_up", "bytes_down", "weights_bytes_up"):
            assert a[key] == b[key], key
    # The device ran the programs: its peak is their memory plan, not PyTorch's meter.
    planned = {float(r["peak_memory_bytes"]) for r in executorch_rows}
    assert len(planned) == 1 and planned != {float(r["peak_memory_bytes"]) for r in eager_rows}


def test_clientapps_running_at_once_train_through_executorch_as_they_do_eagerly(tmp_path):
    # Rounds of 10 batches (the last one 8): long enough that the two devices' rounds overlap.
    two = ("num_clients=2", "strategy.min_train_nodes=2", "dataset.samples_per_client=152")
    eager, _ = run_with_runtime(tmp_path, "cnn", "eager", *two, concurrency=2)
    PROGRAMS.clear()
    executorch, rows = run_with_runtime(tmp_path, "cnn", "executorch", *two, concurrency=2)

    assert [r["status"] for r in rows] == ["ok"] * 4
    assert max_param_diff(executorch.model, eager.model) <= TOLERANCE
    assert 2 <= PROGRAMS.exports <= 4  # at most a program per shape per device, in round 1
