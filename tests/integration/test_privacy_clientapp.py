"""The ClientApp keeps its privacy accountant in ``context.state`` and declines past its budget."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ConfigRecord

from clients.app import ACCOUNTANT_STATE_KEY, build_client_app
from experiments.local import LocalGrid, in_process_channels
from server.app import (
    RoundReporter,
    initial_arrays,
    make_strategy,
    run_training,
    start_runtime,
    stop_runtime,
)
from splitlearn.dataplane import InProcessTransport, TrunkChannel
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import decode_tensor
from splitlearn.messages import STATUS_KEY
from splitlearn.privacy import compute_epsilon
from splitlearn.privacy.ledger import load_ledger
from tests.conftest import small_config
from tests.integration.test_simulation import read_clients
from tests.integration.test_ushaped_dataplane import RecordingTransport


def forward_rows(data: bytes) -> list[torch.Tensor]:
    """The activation rows of one request frame (none for other kinds of frame)."""
    request = pb.Request.FromString(data)
    if request.WhichOneof("kind") not in ("forward", "evaluate"):
        return []
    part = getattr(request, request.WhichOneof("kind"))
    return list(decode_tensor(part.activations, name="activations", max_bytes=2**30).flatten(1))


def recording_channels(runtime, frames: list[bytes]):
    """A ClientApp channel factory over the in-process transport that keeps every frame sent."""

    def recording(address, token, spec, *, proof=None):
        return TrunkChannel(RecordingTransport(InProcessTransport(runtime.endpoint, token,
                                                                  proof=proof), frames),
                            reply_timeout_s=spec.reply_timeout_s,
                            max_frame_bytes=spec.max_frame_bytes)

    return recording


def test_epsilon_accumulates_in_context_state_until_the_budget_stops_training(tmp_path):
    sigma = 0.5
    one_round = compute_epsilon(history=[(sigma / 2, 1.0, 1)], delta=1e-5)
    two_rounds = compute_epsilon(history=[(sigma / 2, 1.0, 2)], delta=1e-5)
    cfg = small_config(
        "strategy.num_rounds=3", "privacy=activation_gaussian", f"privacy.noise_multiplier={sigma}",
        "privacy.clip_norm=5", f"privacy.epsilon_max={(one_round + two_rounds) / 2}",
        run_dir=str(tmp_path),
    )
    runtime = start_runtime(cfg)
    try:
        grid = LocalGrid(build_client_app(in_process_channels(runtime.endpoint)),
                         num_nodes=cfg.num_clients)
        history = run_training(grid, runtime).history
    finally:
        stop_runtime(runtime)
    by_round = {r["round"]: r for r in history}
    # Round 1 trains everyone and costs one release per example; round 2 would pass the
    # budget, so every client declines; round 3 samples nobody (the guard remembers).
    assert by_round[1]["examples"] > 0 and by_round[1]["clients_budget"] == 0
    assert by_round[1]["epsilon"] == pytest.approx(one_round)
    # Rows are accounted at rate 1: the server sees nothing sampling would hide.
    assert by_round[1]["epsilon_vs_server"] == pytest.approx(one_round)
    assert by_round[2]["examples"] == 0 and by_round[2]["clients_budget"] == cfg.num_clients
    assert by_round[3]["examples"] == 0
    assert by_round[3]["epsilon"] == pytest.approx(one_round)  # never charged past round 1
    for context in grid.contexts.values():
        # The spend persisted in each node's state: one accounted epoch, nothing more.
        assert list(context.state[ACCOUNTANT_STATE_KEY]["num-steps"]) == [1]


def test_federated_evaluation_releases_noised_rows_and_is_charged(tmp_path):
    """A server that evaluates anyway (the guard would not) gets clipped, noised rows, and
    each evaluation costs the node an epoch of its budget: repeats cannot be averaged free."""
    sigma, clip = 0.5, 5.0
    one = compute_epsilon(history=[(sigma / 2, 1.0, 1)], delta=1e-5)
    two = compute_epsilon(history=[(sigma / 2, 1.0, 2)], delta=1e-5)
    cfg = small_config(
        "strategy.fraction_evaluate=1.0", "privacy=activation_gaussian",
        f"privacy.noise_multiplier={sigma}", f"privacy.clip_norm={clip}",
        f"privacy.epsilon_max={(one + two) / 2}",
        run_dir=str(tmp_path),
    )
    runtime = start_runtime(cfg)
    frames: list[bytes] = []
    recording = recording_channels(runtime, frames)

    try:
        grid = LocalGrid(build_client_app(recording), num_nodes=cfg.num_clients)
        inner = make_strategy(runtime, RoundReporter(runtime)).strategy  # past the guard

        def evaluate(server_round):
            messages = inner.configure_evaluate(server_round, initial_arrays(runtime),
                                                ConfigRecord(), grid)
            return list(grid.send_and_receive(messages))

        first = evaluate(1)
        released = [row for data in frames for row in forward_rows(data)]
        frames.clear()
        second = evaluate(2)
    finally:
        stop_runtime(runtime)
    assert len(first) == cfg.num_clients
    for reply in first:
        assert reply.content["metrics"]["epsilon"] == pytest.approx(one)
    # On the wire: noise of std sigma * C around clipped rows, whose norm <= C bounds their
    # mean coordinate by C / sqrt(dims), not the raw ReLU activations.
    rows = torch.stack(released)
    assert rows.shape[0] > 100
    assert rows.std().item() == pytest.approx(sigma * clip, rel=0.02)
    assert abs(rows.mean().item()) <= clip / rows.shape[1] ** 0.5 + 0.01
    # A second evaluation would pass the budget: every node declines, sends nothing.
    assert frames == []
    assert {r.content[STATUS_KEY]["status"] for r in second} == {"budget"}
    for context in grid.contexts.values():
        assert list(context.state[ACCOUNTANT_STATE_KEY]["num-steps"]) == [1]


def test_nodes_hold_the_server_to_their_own_privacy_floor(tmp_path):
    """Node 1 requires sigma >= 1 and refuses the server's 0.5; node 2's own budget (one
    round's epsilon) is tighter than the server's (none): it trains once, then declines."""
    sigma = 0.5
    one = compute_epsilon(history=[(sigma / 2, 1.0, 1)], delta=1e-5)
    cfg = small_config("privacy=activation_gaussian", f"privacy.noise_multiplier={sigma}",
                       "privacy.clip_norm=5", run_dir=str(tmp_path))
    runtime = start_runtime(cfg)
    try:
        grid = LocalGrid(build_client_app(in_process_channels(runtime.endpoint)),
                         num_nodes=cfg.num_clients)
        grid.contexts[1].node_config["privacy-min-noise-multiplier"] = 1.0
        grid.contexts[2].node_config["privacy-epsilon-max"] = one * 1.01
        result = run_training(grid, runtime)
    finally:
        stop_runtime(runtime)
    by_round = {r["round"]: r for r in result.history}
    assert by_round[1]["clients_privacy"] == 1 and by_round[2]["clients_privacy"] == 1
    assert by_round[1]["clients_budget"] == 0 and by_round[2]["clients_budget"] == 1
    assert by_round[2]["examples"] > 0  # node 3 trains on
    rows = read_clients(tmp_path)
    refused = [r for r in rows if r["status"] == "privacy"]
    assert {r["partition_id"] for r in refused} == {"0"}
    assert all("requires at least 1.0" in r["reason"] for r in refused)
    assert ACCOUNTANT_STATE_KEY not in grid.contexts[1].state.config_records  # nothing spent
    assert list(grid.contexts[2].state[ACCOUNTANT_STATE_KEY]["num-steps"]) == [1]


def test_a_restarted_node_and_a_new_run_continue_from_the_ledger(tmp_path):
    """Fresh contexts (restarted SuperNodes) in a new run start from what each node's ledger
    file holds, not from zero: past the budget they decline at once."""
    sigma = 0.5
    one = compute_epsilon(history=[(sigma / 2, 1.0, 1)], delta=1e-5)
    two = compute_epsilon(history=[(sigma / 2, 1.0, 2)], delta=1e-5)
    ledgers = {node: tmp_path / "device" / f"node{node}.json" for node in (1, 2, 3)}

    def run(name: str, *overrides: str) -> list[dict]:
        cfg = small_config("strategy.num_rounds=1", "privacy=activation_gaussian",
                           f"privacy.noise_multiplier={sigma}", "privacy.clip_norm=5",
                           *overrides, run_dir=str(tmp_path / name))
        runtime = start_runtime(cfg)
        try:
            grid = LocalGrid(build_client_app(in_process_channels(runtime.endpoint)),
                             num_nodes=cfg.num_clients)
            for node, path in ledgers.items():
                grid.contexts[node].node_config["privacy-ledger"] = str(path)
            return run_training(grid, runtime).history
        finally:
            stop_runtime(runtime)

    first = run("first")
    assert first[1]["clients_budget"] == 0 and first[1]["epsilon"] == pytest.approx(one)
    assert all(load_ledger(p).epsilon(1e-5) == pytest.approx(one) for p in ledgers.values())
    second = run("second", f"privacy.epsilon_max={(one + two) / 2}")
    assert second[1]["clients_budget"] == 3 and second[1]["examples"] == 0
    assert all(load_ledger(p).epsilon(1e-5) == pytest.approx(one) for p in ledgers.values())


def test_activation_noise_follows_each_clients_own_cut(tmp_path):
    """Per-client cuts (they differ within the round): every client's rows leave clipped and
    noised at its own cut, and the accounting is the same as at one cut (a release per
    example, whatever its width)."""
    sigma, clip = 0.5, 5.0
    one_round = compute_epsilon(history=[(sigma / 2, 1.0, 1)], delta=1e-5)
    cfg = small_config(
        "strategy.num_rounds=1", "planner=rotate", "planner.cuts=[1,2,3]",
        "privacy=activation_gaussian", f"privacy.noise_multiplier={sigma}",
        f"privacy.clip_norm={clip}", run_dir=str(tmp_path),
    )
    runtime = start_runtime(cfg)
    frames: list[bytes] = []
    recording = recording_channels(runtime, frames)

    try:
        grid = LocalGrid(build_client_app(recording), num_nodes=cfg.num_clients)
        history = run_training(grid, runtime).history
    finally:
        stop_runtime(runtime)
    assert history[1]["examples"] > 0 and history[1]["epsilon"] == pytest.approx(one_round)
    assert {int(float(r["cut"])) for r in read_clients(tmp_path)} == {1, 2, 3}
    by_width: dict[int, list[torch.Tensor]] = {}
    for data in frames:
        for row in forward_rows(data):
            by_width.setdefault(row.numel(), []).append(row)
    assert len(by_width) == 3  # one activation width per cut
    for rows in by_width.values():
        stacked = torch.stack(rows)
        assert stacked.std().item() == pytest.approx(sigma * clip, rel=0.05)
        assert abs(stacked.mean().item()) <= clip / stacked.shape[1] ** 0.5 + 0.02


def sent_labels(frames: list[bytes]) -> torch.Tensor:
    """The labels of every training frame sent, in the order sent."""
    labels = []
    for data in frames:
        request = pb.Request.FromString(data)
        if request.WhichOneof("kind") == "forward":
            labels.append(decode_tensor(request.forward.labels, name="labels", max_bytes=2**20))
    return torch.cat(labels)


def test_label_dp_sends_the_same_randomised_labels_every_round(tmp_path):
    """SplitFed sends labels to the trunk: under privacy.label_epsilon each example's label is
    the node's one randomised draw, the same in both rounds, kept at randomised response's rate."""
    from torch.utils.data import TensorDataset

    from clients.loop import epoch_loader
    from splitlearn.data import client_dataset
    from splitlearn.privacy.labels import keep_probability

    cfg = small_config("strategy.num_rounds=2", "privacy.label_epsilon=1.0", run_dir=str(tmp_path))
    runtime = start_runtime(cfg)
    frames: dict[tuple[int, str], list[bytes]] = {}

    def recording(address, token, spec, *, proof=None):
        grant = runtime.tokens.lookup(token)
        kept = frames.setdefault((grant.server_round, grant.client), [])
        return TrunkChannel(RecordingTransport(InProcessTransport(runtime.endpoint, token,
                                                                  proof=proof), kept),
                            reply_timeout_s=spec.reply_timeout_s,
                            max_frame_bytes=spec.max_frame_bytes)

    try:
        grid = LocalGrid(build_client_app(recording), num_nodes=cfg.num_clients)
        run_training(grid, runtime)
    finally:
        stop_runtime(runtime)
    # (Learning is not asserted: at eps 1 over 10 classes 77% of the labels are wrong, and
    # 2 rounds can end at chance.)
    spec = runtime.spec
    for node in grid.contexts:
        true = client_dataset(spec.dataset, spec.partitioner, seed=spec.seed,
                              partition_id=node - 1, num_partitions=cfg.num_clients).tensors[1]
        released = []
        for server_round in (1, 2):
            # Without activation noise the batch order follows from the task: replay it to
            # put each sent label back at its example.
            order = torch.cat([i for i, _ in epoch_loader(
                TensorDataset(torch.arange(len(true)), true), spec, server_round=server_round,
                partition_id=node - 1)])
            by_example = torch.empty_like(true)
            by_example[order] = sent_labels(frames[(server_round, str(node))])
            released.append(by_example)
        assert torch.equal(released[0], released[1])  # one draw, kept: nothing new released
        kept = float((released[0] == true).float().mean())
        assert abs(kept - keep_probability(1.0, 10)) < 0.12  # 0.23 at eps 1 over 10 classes
    rows = read_clients(tmp_path)
    assert {r["status"] for r in rows} == {"ok"} and len(rows) == 2 * cfg.num_clients
    assert {float(r["label_epsilon"]) for r in rows} == {1.0}


def test_ushaped_devices_noise_the_gradient_they_return_and_account_for_it(tmp_path):
    """Each backward frame carries clipped, noised rows (std sigma x C / B), and every node's
    accountant holds one release per example and local epoch, round after round."""
    sigma, clip = 1.0, 1.0
    cfg = small_config("strategy=ushaped", "strategy.num_rounds=2",
                       f"privacy.gradient_noise_multiplier={sigma}",
                       f"privacy.gradient_clip_norm={clip}", run_dir=str(tmp_path))
    runtime = start_runtime(cfg)
    frames: list[bytes] = []
    try:
        grid = LocalGrid(build_client_app(recording_channels(runtime, frames)),
                         num_nodes=cfg.num_clients)
        run_training(grid, runtime)
    finally:
        stop_runtime(runtime)
    stds = []
    for data in frames:
        request = pb.Request.FromString(data)
        if request.WhichOneof("kind") == "backward":
            grad = decode_tensor(request.backward.grad, name="grad", max_bytes=2**24)
            stds.append((float(grad.std()), len(grad)))
    assert stds
    # Noise dominates: the clipped signal of one row is at most C / B in norm over many
    # coordinates, the noise sigma x C / B per coordinate.
    assert all(std == pytest.approx(sigma * clip / rows, rel=0.25) for std, rows in stds)
    expected = compute_epsilon(history=[(sigma / 2, 1.0, 2)], delta=1e-5)
    rows = [r for r in read_clients(tmp_path) if r["round"] == "2"]
    assert rows and all(float(r["gradient_epsilon"]) == pytest.approx(expected) for r in rows)
