"""Tests for cutting models and for the bottom state-dict helpers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from splitlearn.models import MODELS, SplittableModel, build_model
from splitlearn.stages import bottom_state, bottom_state_keys, load_bottom_state, split

CASES = [(name, cut) for name in sorted(MODELS) for cut in (1, 2, 3, 4)]


def _model(name: str, seed: int = 0) -> SplittableModel:
    return build_model(name, in_channels=3, image_size=8, num_classes=10, seed=seed)


def _batch(seed: int, size: int = 8) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 3, 8, 8, generator=gen)
    y = torch.randint(0, 10, (size,), generator=gen)
    return x, y


def _split_step(bottom: nn.Module, trunk: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Forward/backward the split-learning way: detached activation at the cut."""
    act = bottom(x)
    received = act.detach().requires_grad_()
    loss = nn.functional.cross_entropy(trunk(received), y)
    loss.backward()
    act.backward(received.grad)
    return loss


def test_split_shares_modules() -> None:
    model = _model("cnn")
    bottom, trunk = split(model, 2)
    assert len(bottom) == 2 and len(trunk) == 3
    assert bottom[1] is model.stages[1]
    assert trunk[0] is model.stages[2]
    with torch.no_grad():
        bottom[0][0].weight.zero_()
    assert torch.count_nonzero(model.stages[0][0].weight) == 0


@pytest.mark.parametrize("name,cut", CASES)
@pytest.mark.parametrize("train", [True, False])
def test_split_forward_matches(name: str, cut: int, train: bool) -> None:
    model = _model(name).train(train)
    x, _ = _batch(1)
    with torch.no_grad():
        expected = model(x)
        bottom, trunk = split(model, cut)
        got = trunk(bottom(x))
    assert (got - expected).abs().max().item() <= 1e-6


@pytest.mark.parametrize("name,cut", CASES)
@pytest.mark.parametrize("train", [True, False])
def test_split_gradients_match(name: str, cut: int, train: bool) -> None:
    whole = _model(name).train(train)
    halves = copy.deepcopy(whole)
    x, y = _batch(2)
    nn.functional.cross_entropy(whole(x), y).backward()
    _split_step(*split(halves, cut), x, y)
    for (key, p), q in zip(
        whole.named_parameters(), halves.parameters(), strict=True
    ):
        assert q.grad is not None, key
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("name,cut", CASES)
def test_split_sgd_matches_whole(name: str, cut: int) -> None:
    whole = _model(name, seed=3).train()
    halves = copy.deepcopy(whole)
    bottom, trunk = split(halves, cut)
    lr = 0.05
    opt_whole = torch.optim.SGD(whole.parameters(), lr=lr)
    opt_bottom = torch.optim.SGD(bottom.parameters(), lr=lr)
    opt_trunk = torch.optim.SGD(trunk.parameters(), lr=lr)
    for step in range(20):
        x, y = _batch(100 + step)
        opt_whole.zero_grad()
        nn.functional.cross_entropy(whole(x), y).backward()
        opt_whole.step()
        opt_bottom.zero_grad()
        opt_trunk.zero_grad()
        _split_step(bottom, trunk, x, y)
        opt_bottom.step()
        opt_trunk.step()
    # Buffers too: BatchNorm running stats must evolve identically.
    for (key, a), b in zip(
        whole.state_dict().items(), halves.state_dict().values(), strict=True
    ):
        diff = (a.double() - b.double()).abs().max().item()
        assert diff <= 1e-5, key


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("cut", [0, 5, -1, 2.5, "1", None])
def test_invalid_cut(name: str, cut: object) -> None:
    model = _model(name)
    for func in (split, bottom_state_keys, bottom_state):
        with pytest.raises(ValueError, match=r"valid cuts are \[1, 2, 3, 4\]"):
            func(model, cut)  # type: ignore[arg-type]


def test_bottom_keys_use_stage_index() -> None:
    model = _model("resnet")
    keys2 = bottom_state_keys(model, 2)
    keys3 = bottom_state_keys(model, 3)
    assert keys2 == list(split(model, 2)[0].state_dict())
    assert keys3[: len(keys2)] == keys2  # cut-independent prefix keys
    assert {k.split(".")[0] for k in keys3} == {"0", "1", "2"}
    # BatchNorm buffers are part of the client state.
    assert "0.1.running_mean" in keys2
    assert "0.1.running_var" in keys2
    assert "0.1.num_batches_tracked" in keys2


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bottom_state_round_trip(name: str) -> None:
    source = _model(name, seed=1)
    source.train()
    source(_batch(5)[0])  # move BN running stats away from their init
    state = bottom_state(source, 3)
    assert list(state) == bottom_state_keys(source, 3)

    target = _model(name, seed=2)
    untouched = {k: v.clone() for k, v in split(target, 3)[1].state_dict().items()}
    load_bottom_state(target, state)
    for key, value in bottom_state(target, 3).items():
        assert torch.equal(value, state[key]), key
    for key, value in split(target, 3)[1].state_dict().items():
        assert torch.equal(value, untouched[key]), key


def test_bottom_state_is_detached_copy() -> None:
    model = _model("cnn")
    state = bottom_state(model, 1)
    assert all(not v.requires_grad for v in state.values())
    with torch.no_grad():
        model.stages[0][0].weight.add_(1.0)
    assert not torch.equal(state["0.0.weight"], model.stages[0][0].weight)


def test_load_bottom_state_rejects_partial_stage() -> None:
    model = _model("resnet")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = bottom_state(_model("resnet", seed=9), 2)
    del state["1.0.bn1.running_var"]
    with pytest.raises(ValueError, match="running_var"):
        load_bottom_state(model, state)
    # Validation happens before copying: stage 0 was not loaded either.
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize(
    "bad",
    [{"9.weight": torch.zeros(1)}, {"x.weight": torch.zeros(1)}, {"4": torch.zeros(1)}],
)
def test_load_bottom_state_rejects_bad_keys(bad: dict[str, Tensor]) -> None:
    with pytest.raises(ValueError):
        load_bottom_state(_model("cnn"), bad)


def test_load_bottom_state_rejects_wrong_shape() -> None:
    model = _model("cnn")
    state = bottom_state(model, 1)
    state["0.0.bias"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        load_bottom_state(model, state)
