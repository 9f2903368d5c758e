"""Where the trunk computes and in what precision (``server.device``, ``server.precision``).

Tests marked ``cuda`` run the trunk on a CUDA device and skip without one: the test
command runs on CPUs, the GPU check (``python -m benchmarks gpu``) runs them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from protocols import check_config, compose_config
from server.trunk import Trunk
from splitlearn.accelerators import resolve_device
from splitlearn.config import OptimizerConfig
from splitlearn.stages import split
from tests.conftest import digits_like_model, fixed_batches
from tests.helpers import max_param_diff

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def composed(*overrides: str):
    return compose_config(["logger=none", "num_clients=3", *overrides])


def test_auto_is_an_accelerator_when_there_is_one_and_the_cpu_otherwise():
    expected = "cuda" if CUDA else ("mps" if torch.backends.mps.is_available() else "cpu")
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_asking_for_cuda_without_it_is_refused_before_the_run_naming_the_key(name):
    with pytest.raises(ValueError, match=f"server.device={name}: this machine has no CUDA"):
        check_config(composed(f"server.device={name}"))


@pytest.mark.parametrize(("override", "message"), [
    ("server.device=tpu", "server.device='tpu'; accepted"),
    ("server.device=cuda:x", "server.device='cuda:x'; accepted"),
    ("server.precision=fp8", "server.precision='fp8'; accepted"),
])
def test_an_unknown_device_or_precision_fails_at_composition(override, message):
    with pytest.raises(ValueError, match=message):
        check_config(composed(override))


def trunk_logits(trunk: Trunk, x: torch.Tensor, cut: int) -> torch.Tensor:
    with trunk.forward_only(train=False):
        return trunk.run(x, cut)


@pytest.mark.parametrize("cut", [1, 3])
def test_a_bf16_trunk_runs_its_forward_under_autocast_and_answers_in_float32(cut):
    model = digits_like_model()
    x = torch.rand(16, *model.cut_shape(cut))
    bf16 = Trunk(copy.deepcopy(model), lr=0.1, precision="bf16", channels_last=False)
    fp32 = Trunk(copy.deepcopy(model), lr=0.1, channels_last=False)
    got, full = trunk_logits(bf16, x, cut), trunk_logits(fp32, x, cut)
    _, top = split(copy.deepcopy(model).eval(), cut)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        reference = top(x)
    assert got.dtype == torch.float32
    assert torch.equal(got, reference.float())  # exactly autocast's forward
    assert not torch.equal(got, full)  # ... which is not float32's
    torch.testing.assert_close(got, full, rtol=0.05, atol=0.05)  # ... but near it
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())


def test_a_bf16_trunks_cut_gradient_is_autocasts_and_points_where_float32s_does():
    model = digits_like_model()
    x, y = fixed_batches(1)[0]
    bottom, top = split(copy.deepcopy(model), 1)
    acts = bottom(x).detach()
    grads = {}
    for precision in ("fp32", "bf16"):
        trunk = Trunk(copy.deepcopy(model), lr=0.1, precision=precision, channels_last=False)
        leaf = acts.clone().requires_grad_(True)
        with trunk.step(samples=len(y), from_stage=1) as backward:
            backward(nn.functional.cross_entropy(trunk.run(leaf, 1), y))
        assert leaf.grad is not None and leaf.grad.dtype == torch.float32
        grads[precision] = leaf.grad
    leaf = acts.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = top(leaf)
    nn.functional.cross_entropy(logits.float(), y).backward()
    assert torch.equal(grads["bf16"], leaf.grad)  # exactly autocast's backward
    # bfloat16 keeps 8 bits of mantissa: the gradient's entries move (12% of its norm on
    # this untrained CNN), its direction barely does.
    cosine = nn.functional.cosine_similarity(grads["bf16"].flatten(), grads["fp32"].flatten(),
                                             dim=0)
    assert not torch.equal(grads["bf16"], grads["fp32"]) and cosine > 0.98


def test_states_a_trunk_hands_out_are_on_the_host():
    trunk = Trunk(digits_like_model(), lr=0.1, momentum=0.9,
                  optimizer=OptimizerConfig(_target_="torch.optim.Adam"))
    x, y = fixed_batches(1)[0]
    bottom, _ = split(digits_like_model(), 1)
    with trunk.step(samples=len(y), from_stage=1) as backward:
        backward(nn.functional.cross_entropy(trunk.run(bottom(x).detach(), 1), y))
    saved = trunk.state_dict()
    tensors = [*trunk.stage_state().values(), *trunk.optimizer_state().values(),
               *saved["model"].values(), *trunk.snapshot().parameters(),
               *trunk.host_model().parameters()]
    assert tensors and all(t.device.type == "cpu" for t in tensors)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_trunk_on_cuda_trains_as_the_cpu_one_does_and_answers_on_the_host(precision):
    model = digits_like_model()
    batches = fixed_batches(3)
    bottom, _ = split(copy.deepcopy(model), 1)
    trunks = {name: Trunk(copy.deepcopy(model), lr=0.1, momentum=0.5, device=name,
                          precision=precision, channels_last=False) for name in ("cpu", "cuda")}
    for x, y in batches:
        acts = bottom(x).detach()
        answers = {}
        for name, trunk in trunks.items():
            leaf = acts.clone().requires_grad_(True)
            with trunk.step(samples=len(y), from_stage=1) as backward:
                backward(nn.functional.cross_entropy(trunk.run(leaf, 1), y))
            assert leaf.grad is not None and leaf.grad.device.type == "cpu"
            answers[name] = leaf.grad
        tolerance = 1e-4 if precision == "fp32" else 5e-2
        torch.testing.assert_close(answers["cuda"], answers["cpu"], rtol=tolerance,
                                   atol=tolerance * 1e-2)
    assert max_param_diff(trunks["cuda"].snapshot(), trunks["cpu"].snapshot()) < 1e-4
    assert all(t.device.type == "cpu" for t in trunks["cuda"].stage_state().values())
