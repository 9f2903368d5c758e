"""LightSGD steps exactly as torch.optim.SGD, without building a torch Optimizer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from splitlearn.light_sgd import LightSGD
from tests.helpers import imports_in_a_fresh_process


def two_copies(seed: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3))
    twin = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3))
    twin.load_state_dict(net.state_dict())
    return net, twin


@settings(max_examples=25, deadline=None)
@given(lr=st.floats(1e-4, 1.0), momentum=st.sampled_from([0.0, 0.5, 0.9]),
       weight_decay=st.sampled_from([0.0, 1e-4, 0.01]), steps=st.integers(1, 4),
       frozen=st.booleans(), seed=st.integers(0, 2**16))
def test_every_step_is_torchs_sgd_bit_for_bit(lr, momentum, weight_decay, steps, frozen, seed):
    ours, reference = two_copies(seed)
    if frozen:  # a parameter without a gradient is left alone by both
        ours[0].bias.requires_grad_(False)
        reference[0].bias.requires_grad_(False)
    mine = LightSGD(ours.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    torchs = torch.optim.SGD(reference.parameters(), lr=lr, momentum=momentum,
                             weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 1, 8, 8, generator=generator)
        for net, optimizer in ((ours, mine), (reference, torchs)):
            optimizer.zero_grad(set_to_none=True)
            net(x).square().mean().backward()
            optimizer.step()
    for a, b in zip(ours.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(ours.parameters(), reference.parameters(), strict=True):
        mine_buffer = mine.state.get(a, {}).get("momentum_buffer")
        torch_buffer = torchs.state.get(b, {}).get("momentum_buffer")
        assert (mine_buffer is None) == (torch_buffer is None)
        assert mine_buffer is None or torch.equal(mine_buffer, torch_buffer)


def step_both(pairs, seed: int, steps: int = 2) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 1, 8, 8, generator=generator)
        for net, optimizer in pairs:
            optimizer.zero_grad(set_to_none=True)
            net(x).square().mean().backward()
            optimizer.step()


def momentum_by_index(state_dict) -> dict[int, torch.Tensor]:
    return {i: s["momentum_buffer"] for i, s in state_dict["state"].items()
            if s.get("momentum_buffer") is not None}


@settings(max_examples=10, deadline=None)
@given(momentum=st.sampled_from([0.0, 0.5]), seed=st.integers(0, 2**16))
def test_the_state_dict_is_torchs_and_each_loads_the_others(momentum, seed):
    ours, reference = two_copies(seed)
    hyper = {"lr": 0.05, "momentum": momentum, "weight_decay": 1e-4}
    mine, torchs = LightSGD(ours.parameters(), **hyper), torch.optim.SGD(
        reference.parameters(), **hyper)
    step_both([(ours, mine), (reference, torchs)], seed)
    saved_mine, saved_torchs = mine.state_dict(), torchs.state_dict()
    assert saved_mine["param_groups"] == saved_torchs["param_groups"]
    mine_momentum, torch_momentum = momentum_by_index(saved_mine), momentum_by_index(saved_torchs)
    assert mine_momentum.keys() == torch_momentum.keys()
    assert all(torch.equal(mine_momentum[i], torch_momentum[i]) for i in mine_momentum)
    # Swap: a fresh LightSGD resumes torch's state and vice versa, and they stay equal.
    resumed_mine = LightSGD(ours.parameters(), lr=1.0)
    resumed_mine.load_state_dict(saved_torchs)
    resumed_torchs = torch.optim.SGD(reference.parameters(), lr=1.0)
    resumed_torchs.load_state_dict(saved_mine)
    step_both([(ours, resumed_mine), (reference, resumed_torchs)], seed + 1)
    for a, b in zip(ours.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_loading_returns_copies_and_refuses_another_shape():
    layer = nn.Linear(2, 2)
    optimizer = LightSGD(layer.parameters(), lr=0.1, momentum=0.5)
    layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    fresh = LightSGD(layer.parameters(), lr=0.1)
    fresh.load_state_dict(saved)
    assert fresh.momentum == 0.5
    saved["state"][0]["momentum_buffer"].add_(1.0)  # the caller's tensor, not the loaded one
    assert not torch.equal(fresh.state[layer.weight]["momentum_buffer"],
                           saved["state"][0]["momentum_buffer"])
    with pytest.raises(ValueError, match="one group of 1"):
        LightSGD([layer.weight], lr=0.1).load_state_dict(saved)
    nesterov = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.5, nesterov=True)
    with pytest.raises(ValueError, match="Nesterov"):
        fresh.load_state_dict(nesterov.state_dict())


def test_zero_grad_drops_or_zeroes_the_gradients():
    layer = nn.Linear(2, 2)
    optimizer = LightSGD(layer.parameters(), lr=0.1)
    layer(torch.ones(1, 2)).sum().backward()
    optimizer.zero_grad(set_to_none=False)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in layer.parameters())
    optimizer.zero_grad()
    assert all(p.grad is None for p in layer.parameters())


def test_a_fresh_process_steps_without_importing_torchs_compiler():
    """What the device saves: torch.optim.SGD's first construction imports torch._dynamo."""
    assert not imports_in_a_fresh_process("""
        import torch
        from torch import nn
        from splitlearn.light_sgd import LightSGD
        m = nn.Linear(2, 2)
        o = LightSGD(m.parameters(), lr=0.1, momentum=0.5)
        m(torch.ones(1, 2)).sum().backward()
        o.step()
        """, "torch._dynamo")
