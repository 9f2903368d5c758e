"""SGLR: one trunk step over the clients' batches, every client the averaged cut gradient."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from strategies.sglr import SGLROptions
from tests.conftest import digits_like_model, fixed_batches
from tests.helpers import max_param_diff

LR = 0.1
CUT = 2


def exchange_together(server, batches):
    """Each client sends one batch at the same time; return what each got back."""
    channels = [server.local_channel(server.token(CUT, client=f"c{i}"))
                for i in range(len(batches))]  # attached before anyone sends: one barrier
    replies: dict[int, torch.Tensor] = {}

    def send(i: int) -> None:
        replies[i] = channels[i].forward(*batches[i])[0]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for channel in channels:
        channel.close()
    return [replies[i] for i in range(len(batches))]


def smashed(model, seed: int, batch: int):
    x, y = fixed_batches(1, batch=batch, seed=seed)[0]
    return nn.Sequential(*model.stages[:CUT])(x).detach(), y


@pytest.mark.parametrize("scale", [0.0, 3.0])
def test_one_step_over_the_group_and_one_averaged_gradient_for_everyone(
    trunk_server_factory, scale
):
    model = digits_like_model("cnn")
    server = trunk_server_factory(model, protocol="sglr", lr=LR, options=SGLROptions(
        server_lr_scale=scale, barrier_timeout_s=30.0))
    batches = [smashed(model, seed, batch=6) for seed in (1, 2)]
    # Reference, on a copy of the trunk before the step: each client's own cut gradient
    # of its mean loss, and an SGD step on the scaled sum of the mean losses.
    reference = copy.deepcopy(model)
    leaves = [a.clone().requires_grad_(True) for a, _ in batches]
    losses = [nn.functional.cross_entropy(nn.Sequential(*reference.stages[CUT:])(leaf), y)
              for leaf, (_, y) in zip(leaves, batches, strict=True)]
    factor = scale or len(batches)
    (factor * sum(losses)).backward()
    with torch.no_grad():
        for p in reference.stages[CUT:].parameters():
            p -= LR * p.grad
    expected = torch.stack([leaf.grad / factor for leaf in leaves]).mean(dim=0)

    got = exchange_together(server, batches)
    assert server.trunk.steps == 1 and server.handler.steps == 1
    for grad in got:  # every client of the step receives the same, averaged gradient
        assert torch.allclose(grad, expected, atol=1e-6)
    assert max_param_diff(server.model, reference) < 1e-6


def test_batches_of_another_size_are_averaged_only_with_their_own(trunk_server_factory):
    model = digits_like_model("cnn")
    server = trunk_server_factory(model, protocol="sglr", lr=LR,
                                  options=SGLROptions(barrier_timeout_s=30.0))
    batches = [smashed(model, 1, batch=6), smashed(model, 2, batch=6), smashed(model, 3, batch=4)]
    got = exchange_together(server, batches)
    assert server.trunk.steps == 1
    assert torch.equal(got[0], got[1]) and got[2].shape == batches[2][0].shape
    # The odd one out gets its own gradient of its own mean loss, on the pre-step trunk.
    leaf = batches[2][0].clone().requires_grad_(True)
    nn.functional.cross_entropy(nn.Sequential(*model.stages[CUT:])(leaf), batches[2][1]).backward()
    assert torch.allclose(got[2], leaf.grad, atol=1e-6)
