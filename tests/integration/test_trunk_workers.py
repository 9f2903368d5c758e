"""SplitFed v2's trunk in several processes (``dataplane.trunk_workers``) against reference maths.

Directly: real worker processes serving gRPC, each client's gradient against the same
step on a copy of the trunk, the merge against the average of those copies (weights
and momentum), revocation reaching the workers, the merged trunk reaching them before
the next sessions, the server's reference rows reaching their guards and their guards'
books coming back, and no process left behind. Through Flower's Simulation Engine: with
one client per worker and no momentum, a run is SplitFed v1's (a trunk copy per client
merged by samples), round by round.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from contextlib import closing

import pytest
import torch

from experiments.local import run_local
from server.app import build_trunk, trunk_recipe
from server.sessions.split import train_on_batch
from server.trunk import Trunk
from server.workers import TrunkWorkers, WorkerError
from splitlearn.config import CompressionConfig
from splitlearn.dataplane import GrpcTransport, TrunkChannel, TrunkRejected
from tests.conftest import small_config
from tests.helpers import RecordingSends, max_param_diff
from tests.integration.test_simulation import read_clients

CUT = 1


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def batch_at_cut(trunk: Trunk, seed: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations of a random digits-shaped batch at the cut, and labels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(size, 1, 8, 8, generator=g)
    with torch.no_grad():
        acts = trunk.run(x, 0, CUT)
    return acts, torch.randint(0, 10, (size,), generator=g)


def channel(address: str, token: str, compression: CompressionConfig | None = None
            ) -> TrunkChannel:
    return TrunkChannel(GrpcTransport(address, token, max_frame_bytes=1 << 22),
                        max_frame_bytes=1 << 22, reply_timeout_s=30, compression=compression)


@contextlib.contextmanager
def two_workers(*overrides: str) -> Iterator[TrunkWorkers]:
    """Two trunk workers of the small config; none left running after."""
    cfg = small_config(*overrides, "dataplane.trunk_workers=2")
    trunk, _, tokens, _ = build_trunk(cfg)
    pool = TrunkWorkers(trunk, tokens, trunk_recipe(cfg), workers=2)
    try:
        yield pool
    finally:
        pids = pool.pids
        pool.stop()
    assert not any(alive(pid) for pid in pids)


@pytest.fixture
def workers():
    with two_workers("strategy.momentum=0.9") as pool:
        yield pool


def reference_copy(trunk: Trunk) -> Trunk:
    hyper = trunk.hyper
    copied = Trunk(copy.deepcopy(trunk.model), lr=hyper["lr"], momentum=hyper["momentum"])
    copied.load_optimizer_state(trunk.optimizer_state())
    return copied


def test_each_worker_steps_its_clients_and_the_merge_averages_weights_and_momentum(workers):
    trunk, tokens = workers.trunk, workers.tokens
    issued = [tokens.issue(client=c, protocol="splitfed_v2", cut=CUT, server_round=1, ttl_s=60)
              for c in ("a", "b", "c")]
    addresses = [workers.route(t) for t in issued]
    assert addresses[0] != addresses[1]  # dealt to different workers
    references = []
    for round_seed, (address, token) in enumerate(zip(addresses[:2], issued[:2], strict=True)):
        ref = reference_copy(trunk)
        with closing(channel(address, token)) as ch:
            for step in range(3):
                acts, labels = batch_at_cut(trunk, 10 * round_seed + step)
                grad, _, _ = ch.forward(acts, labels)
                expected = train_on_batch(ref, CUT, acts, labels).grad
                torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)
        references.append(ref)
    before = trunk.stage_state()
    clients = trunk.stage_state()
    client_side = {k: v for k, v in clients.items() if int(k.split(".")[0]) < CUT}
    workers.merge_round([(client_side, 24), (client_side, 24)], upto=CUT)
    merged = trunk.stage_state()
    for key, value in merged.items():
        if int(key.split(".")[0]) < CUT:
            torch.testing.assert_close(value, before[key])  # the clients' (equal) copies
        else:
            mean = (references[0].stage_state()[key] + references[1].stage_state()[key]) / 2
            torch.testing.assert_close(value, mean, rtol=1e-6, atol=1e-7)
    momentum = trunk.optimizer_state()
    assert momentum and set(momentum) == set(references[0].optimizer_state())
    for key, value in momentum.items():
        mean = (references[0].optimizer_state()[key] + references[1].optimizer_state()[key]) / 2
        torch.testing.assert_close(value, mean, rtol=1e-6, atol=1e-7)
    assert (trunk.steps, trunk.samples) == (6, 48)

    # The round's end reaches the workers: a token of the round never used is refused there.
    tokens.revoke_round(1)
    with (closing(channel(addresses[2], issued[2])) as ch,
          pytest.raises(TrunkRejected, match="token rejected")):
        ch.forward(*batch_at_cut(trunk, 99))

    # The next sessions train the merged trunk (and its merged momentum) in every worker.
    nxt = tokens.issue(client="a", protocol="splitfed_v2", cut=CUT, server_round=2, ttl_s=60)
    ref = reference_copy(trunk)
    with closing(channel(workers.route(nxt), nxt)) as ch:
        acts, labels = batch_at_cut(trunk, 7)
        grad, _, _ = ch.forward(acts, labels)
    torch.testing.assert_close(grad, train_on_batch(ref, CUT, acts, labels).grad,
                               rtol=1e-5, atol=1e-7)


def test_a_client_dealt_to_another_worker_brings_its_error_feedback_along():
    """Round 1 deals a and b to workers 0 and 1, round 2 deals b first: each client's
    references and residuals move to its new worker, so its next batch carries on at its
    version (not refused as stale and started over from zero)."""
    topk = CompressionConfig(uplink="topk", downlink="topk", error_feedback=True)
    with two_workers("compression=topk_feedback") as workers:
        trunk, tokens = workers.trunk, workers.tokens
        acts, labels = batch_at_cut(trunk, 0)
        ids = torch.arange(len(labels))
        kept, dealt = {}, {}
        for server_round, order in ((1, "ab"), (2, "ba")):
            issued = {c: tokens.issue(client=c, protocol="splitfed_v2", cut=CUT,
                                      server_round=server_round, ttl_s=60) for c in order}
            addresses = {c: workers.route(t) for c, t in issued.items()}
            dealt[server_round] = addresses
            for client, token in issued.items():
                with closing(channel(addresses[client], token, topk)) as ch:
                    if client in kept:
                        ch.feedback = kept[client]
                    sent = RecordingSends(ch)
                    for _ in range(2):
                        ch.forward(acts, labels, example_ids=ids)
                    kept[client] = ch.feedback
                assert sent.versions == [2 * server_round - 2, 2 * server_round - 1]
            tokens.revoke_round(server_round)
        assert dealt[2]["a"] == dealt[1]["b"] != dealt[1]["a"] == dealt[2]["b"]


def test_every_workers_guard_is_seeded_and_its_books_are_taken():
    """The reference rows reach each worker's guard before any device's: a frame of rows
    far beyond them (inside the fixed bound) is refused by whichever worker it is dealt
    to, and those refusals come back in the workers' books, once."""
    with two_workers() as workers:
        trunk, tokens = workers.trunk, workers.tokens
        acts, labels = batch_at_cut(trunk, 0, size=32)
        workers.seed_guards({("activations", CUT): acts})
        for client in ("a", "b"):  # dealt to workers 0 and 1
            token = tokens.issue(client=client, protocol="splitfed_v2", cut=CUT,
                                 server_round=1, ttl_s=60)
            with (closing(channel(workers.route(token), token)) as ch,
                  pytest.raises(TrunkRejected) as refused):
                ch.forward(100 * acts, labels)
            assert refused.value.reason == "OUT_OF_RANGE"
        assert workers.take_guard_books() == {"guard_refused": 2, "guard_loss_refused": 0,
                                              "guard_clipped": 0, "guard_quarantined": 0}
        assert workers.take_guard_books()["guard_refused"] == 0


def test_a_worker_that_dies_is_reported_with_its_pid(workers):
    victim = workers._workers[1]
    victim.process.kill()
    victim.process.join(10)
    with pytest.raises(WorkerError, match=rf"trunk worker 1 \(pid {victim.process.pid}\) is gone"):
        workers.merge_round([], upto=CUT)


def test_one_client_per_worker_without_momentum_is_splitfed_v1(tmp_path):
    """Three workers, three clients: each worker trains one client's copy of the trunk and
    the copies are merged by samples, exactly what SplitFed v1 does with its per-client copies.
    (The shipped apps in this process, the workers' trunks over gRPC.)"""
    small = ("strategy.momentum=0", "strategy.num_rounds=2")
    ours = run_local(small_config("dataplane.trunk_workers=3", *small,
                                  run_dir=str(tmp_path / "workers")))
    v1 = run_local(small_config("strategy=splitfed_v1", *small, run_dir=str(tmp_path / "v1")))

    def work(run: str) -> list[tuple[str, ...]]:
        rows = read_clients(tmp_path / run)
        return [tuple(r.get(k, "") for k in ("round", "client", "status", "steps", "reason"))
                for r in rows]

    # Every client trained the same batches in both runs (a failure here names the reason).
    assert work("workers") == work("v1")
    for a, b in zip(ours.history, v1.history, strict=True):
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-4, abs=1e-5)
    # Bit for bit: clients are dealt to the workers in node order from the first each
    # round, and SplitFed v1 merges by partition, which here follows the node id: no sum
    # is reordered.
    assert max_param_diff(ours.model, v1.model) == 0.0

