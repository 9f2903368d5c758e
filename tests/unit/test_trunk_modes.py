"""Trunk modes against reference maths: per-client copies and the batching barrier."""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

from server.trunk import Trunk
from server.trunk_modes import BatchingTrunk, TrunkPerClient
from tests.conftest import digits_like_model, fixed_batches

CUT = 2


def activations(model, seed: int, batch: int = 8):
    x, y = fixed_batches(1, batch=batch, seed=seed)[0]
    with torch.no_grad():
        acts = x
        for stage in model.stages[:CUT]:
            acts = stage(acts)
    return acts, y


def test_per_client_copies_merge_weighted_by_samples_and_drop_unfinished():
    model = digits_like_model()
    pool = TrunkPerClient(Trunk(copy.deepcopy(model), lr=0.1))
    batches = {"a": activations(model, 1, batch=8), "b": activations(model, 2, batch=24),
               "gone": activations(model, 3, batch=8)}
    for client, (acts, y) in batches.items():
        pool.trunk_for(client).train_step(CUT, acts, y)
    # Reference: train separate copies by hand, average a and b by samples (8 : 24).
    refs = {}
    for client in ("a", "b"):
        ref = copy.deepcopy(model)
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        acts, y = batches[client]
        out = acts
        for stage in ref.stages[CUT:]:
            out = stage(out)
        nn.functional.cross_entropy(out, y).backward()
        opt.step()
        refs[client] = ref.state_dict()
    pool.finish_round(["a", "b"])  # "gone" did not finish: its copy is discarded
    merged = pool.trunk.model.state_dict()
    for key, value in merged.items():
        expected = refs["a"][key].double() * 0.25 + refs["b"][key].double() * 0.75
        assert torch.allclose(value.double(), expected, atol=1e-6), key
    assert pool.trunk.samples == 32
    # Copies are gone after the round: a new round forks the merged trunk.
    fresh = pool.trunk_for("a")
    assert fresh.samples == 0
    assert torch.equal(next(fresh.model.parameters()), next(pool.trunk.model.parameters()))


def test_batching_barrier_steps_once_and_returns_each_clients_own_gradient():
    model = digits_like_model()
    trunk = Trunk(copy.deepcopy(model), lr=0.1)
    barrier = BatchingTrunk(trunk, open_streams=lambda: 2, timeout_s=5.0)
    inputs = [activations(model, 1, batch=8), activations(model, 2, batch=16)]
    results = {}

    def client(i: int) -> None:
        results[i] = barrier.train_step(CUT, *inputs[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert barrier.steps == 1 and trunk.steps == 1
    # Reference: each client's gradient of its own mean loss at the pre-step weights.
    for i, (acts, y) in enumerate(inputs):
        ref = copy.deepcopy(model)
        a = acts.clone().requires_grad_(True)
        out = a
        for stage in ref.stages[CUT:]:
            out = stage(out)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        assert torch.allclose(results[i].grad, a.grad, atol=1e-6)
        assert abs(results[i].loss - float(loss.detach())) < 1e-5


def test_batching_barrier_times_out_instead_of_waiting_for_absent_clients():
    model = digits_like_model()
    trunk = Trunk(copy.deepcopy(model), lr=0.1)
    barrier = BatchingTrunk(trunk, open_streams=lambda: 3, timeout_s=0.05)
    result = barrier.train_step(CUT, *activations(model, 1))
    assert result.grad is not None and trunk.steps == 1
