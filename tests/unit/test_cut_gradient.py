"""The backward from the trunk's gradient: the same bits as autograd's own, without sympy."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from clients.cut_gradient import GradientRoot
from splitlearn.models import build_model


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_root_sends_the_gradient_as_autograd_backward_does(channels_last):
    torch.manual_seed(0)
    model = build_model("resnet", in_channels=1, image_size=8, num_classes=10)
    twin = build_model("resnet", in_channels=1, image_size=8, num_classes=10)
    twin.load_state_dict(model.state_dict())
    inputs = torch.randn(6, 1, 8, 8)
    if channels_last:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    bottom, reference = (torch.nn.Sequential(*m.stages[:2]) for m in (model, twin))
    out = bottom(inputs)
    gradient = torch.randn_like(out)
    root = GradientRoot(out)
    del out  # the output may go before the gradient comes
    root.backward(gradient, plus=(bottom[0](inputs) ** 2).mean())
    ref_out = reference(inputs)
    torch.autograd.backward([ref_out, (reference[0](inputs) ** 2).mean()], [gradient, None])
    for p, q in zip(bottom.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_a_gradient_of_another_shape_is_refused():
    out = torch.ones(2, 3, requires_grad=True) * 2
    with pytest.raises(ValueError, match=r"shape \(3, 2\) for an output of shape \(2, 3\)"):
        GradientRoot(out).backward(torch.ones(3, 2))


def test_a_devices_first_split_step_does_not_import_sympy():
    """autograd's own check of a given gradient imports sympy (1.9 s of a device's CPU)."""
    probe = """
import sys, torch
from clients.cut_gradient import GradientRoot
x = torch.ones(4, 3, requires_grad=True)
GradientRoot((x * 2).relu()).backward(torch.ones(4, 3))
assert x.grad is not None
print('sympy' in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == "False"
