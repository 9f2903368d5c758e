"""SGLR: one trunk step over the clients' batches, every client the averaged cut gradient."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from protocols.sglr import SGLROptions
from tests.conftest import digits_like_model, fixed_batches
from tests.helpers import max_param_diff

LR = 0.1
CUT = 2


def exchange_together(server, batches, cuts=None):
    """Each client sends one batch at the same time; return what each got back."""
    cuts = cuts or [CUT] * len(batches)
    channels = [server.local_channel(server.token(cut, client=f"c{i}"))
                for i, cut in enumerate(cuts)]  # attached before anyone sends: one barrier
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


def smashed(model, seed: int, batch: int, cut: int = CUT):
    x, y = fixed_batches(1, batch=batch, seed=seed)[0]
    return nn.Sequential(*model.stages[:cut])(x).detach(), y


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


def test_clients_at_other_cuts_are_stepped_and_averaged_apart(trunk_server_factory):
    """Per-client cuts: a gradient is averaged only over clients holding the same cut, and
    each cut's group takes its own step (cut 1's first: it also trains stage 1)."""
    model = digits_like_model("cnn")
    server = trunk_server_factory(model, protocol="sglr", lr=LR,
                                  options=SGLROptions(barrier_timeout_s=30.0))
    cuts = [1, 2, 1]
    batches = [smashed(model, seed, batch=6, cut=cut) for seed, cut in enumerate(cuts, 1)]
    reference = copy.deepcopy(model)
    expected = {}
    for cut in (1, 2):  # the groups in the order the trunk steps them, on one evolving trunk
        group = [b for b, c in zip(batches, cuts, strict=True) if c == cut]
        leaves = [a.clone().requires_grad_(True) for a, _ in group]
        top = nn.Sequential(*reference.stages[cut:])
        (len(group) * sum(nn.functional.cross_entropy(top(leaf), y)
                          for leaf, (_, y) in zip(leaves, group, strict=True))).backward()
        with torch.no_grad():
            for p in top.parameters():
                p -= LR * p.grad
                p.grad = None
        expected[cut] = torch.stack([leaf.grad / len(group) for leaf in leaves]).mean(dim=0)
    got = exchange_together(server, batches, cuts)
    assert server.trunk.steps == 2
    for grad, cut in zip(got, cuts, strict=True):
        assert torch.allclose(grad, expected[cut], atol=1e-6)
    assert max_param_diff(server.model, reference) < 1e-6
    # Stage 1 trained on the cut-1 clients' 12 samples, the stages above on all 18.
    assert server.trunk.take_stage_samples()[1:] == [12] + [18] * (model.num_stages - 2)
