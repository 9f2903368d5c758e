"""Adaptive splits on the server side: planning rounds, slicing arrays, learning from replies."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from hydra.errors import ConfigCompositionException

from protocols import check_config, compose_config, cuts_in_play
from protocols.splitfed import SplitFedV2Options
from server.sessions.split import SharedTrunk, SplitSession
from server.trunk import Trunk
from splitlearn.calibration import cut_costs
from splitlearn.config import (
    DataPlaneConfig,
    PlannerConfig,
    RunSpec,
    TraceEventConfig,
    to_object,
)
from splitlearn.dataplane import TokenRegistry
from splitlearn.messages import (
    RECOMPUTE_KEY,
    ROUND_KEY,
    STATUS_KEY,
    record_to_state,
    state_to_record,
)
from splitlearn.models.factory import build_model_from_config
from splitlearn.planning.cost import Assignment
from splitlearn.planning.devices import DeviceProfile, apply_traces
from splitlearn.planning.planners import RotatePlanner, SmartSplitPlanner
from splitlearn.stages import bottom_state
from strategies.adaptive import KEPT_PLANS, CutPlanning, prior_state
from strategies.splitfed import DataPlaneAccess, SplitFed
from tests.conftest import digits_like_model
from tests.helpers import ScriptedGrid

pytestmark = pytest.mark.usefixtures("task_identity")


def trained_reply(message: Message, *, samples: int = 32, compute_s: float = 1.0,
                  budget: float = 1e9) -> Message:
    """A client that trained at its cut and returns the weights it got, with its metrics."""
    data = message.content[ROUND_KEY]
    metrics = MetricRecord({
        "num-examples": samples, "steps": 4, "cut": int(data["cut"]),
        RECOMPUTE_KEY: int(bool(data[RECOMPUTE_KEY])), "partition-id": message.metadata.dst_node_id,
        "virtual-compute-s": compute_s, "bytes-up": 1000, "virtual-upload-s": 0.1,
        "bytes-down": 1000, "virtual-download-s": 0.05, "virtual-latency-s": 0.04,
        "memory-budget": budget, "train-loss": 1.0, "label-coverage": 1.0,
    })
    arrays = message.content["arrays"]
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=message)


def declined_for_memory(message: Message, budget: int) -> Message:
    content = RecordDict({
        STATUS_KEY: ConfigRecord({"status": "memory", "reason": "does not fit"}),
        "metrics": MetricRecord({"partition-id": 0, "memory-budget": budget}),
    })
    return Message(content, reply_to=message)


#: The trunk's cost in these tests: seconds per batch, FLOP/s.
TRUNK_BATCH_S, TRUNK_FLOPS = 0.01, 1e9


def trunk_s(batches: int, flops: float) -> float:
    return batches * TRUNK_BATCH_S + flops / TRUNK_FLOPS


def make_splitfed(planner, *, model=None):
    model = model or digits_like_model()
    trunk = Trunk(copy.deepcopy(model), lr=0.05)
    costs = cut_costs(model, batch_size=8)
    steps = [(1, 8 * c.server_flops_per_sample, trunk_s(1, 8 * c.server_flops_per_sample))
             for c in costs]  # one trunk step of 8 at each cut, as measured before a run
    planning = CutPlanning(planner=planner, costs=costs, prior=prior_state(
        PlannerConfig(name="greedy"), batch_size=8, epochs=1),
        trunk_busy_s=lambda: trunk.busy_s, trunk_steps=steps)
    strategy = SplitFed(
        protocol="splitfed_v2", spec=RunSpec(strategy=SplitFedV2Options()),
        dataplane=DataPlaneAccess(TokenRegistry(), "127.0.0.1:1", 60.0),
        trunk=SplitSession(SharedTrunk(trunk), dataplane=DataPlaneConfig()), planning=planning,
        min_available_nodes=1, min_train_nodes=1,
    )
    return strategy, model, trunk, planning


def test_each_client_gets_the_stages_below_its_planned_cut_and_the_merge_covers_them():
    strategy, model, trunk, planning = make_splitfed(RotatePlanner())
    granted: dict[int, int] = {}  # node -> cut its session token grants (while it is valid)

    def answer(message: Message) -> Message:
        grant = strategy.dataplane.tokens.lookup(str(message.content[ROUND_KEY]["token"]))
        granted[message.metadata.dst_node_id] = grant.cut
        return trained_reply(message)

    grid = ScriptedGrid([11, 12, 13], answer)
    start = state_to_record(bottom_state(model, planning.max_cut))
    strategy.start(grid=grid, initial_arrays=start, num_rounds=2)
    first, second = grid.train_calls()
    # Ranks 0-2 by node id rotate over cuts 1-4, round by round; stages sliced to match.
    for call, expected in ((first, {11: 2, 12: 3, 13: 4}), (second, {11: 3, 12: 4, 13: 1})):
        cuts = {m.metadata.dst_node_id: int(m.content[ROUND_KEY]["cut"]) for m in call}
        assert cuts == expected
        for message in call:
            stages = {int(k.split(".")[0]) for k in message.content["arrays"]}
            assert stages == set(range(cuts[message.metadata.dst_node_id]))
            assert message.content[ROUND_KEY][RECOMPUTE_KEY] is False
    # The session token grants the planned cut, so the trunk checks frames against it.
    assert granted == cuts


def test_the_planner_learns_budgets_from_declines_and_the_trunk_speed_from_its_books():
    planner = SmartSplitPlanner(select_fraction=1.0)
    strategy, model, trunk, planning = make_splitfed(planner)
    costs = {c.cut: c for c in cut_costs(model, batch_size=8)}
    budget = costs[1].memory_bytes  # fits cut 1 plainly, nothing deeper without recomputation
    request = Message(RecordDict({ROUND_KEY: ConfigRecord({"cut": 1, RECOMPUTE_KEY: False})}),
                      dst_node_id=5, message_type="train.splitfed_v2")
    ok = Message(RecordDict({ROUND_KEY: ConfigRecord({"cut": 1, RECOMPUTE_KEY: False}),
                             "arrays": ArrayRecord()}),
                 dst_node_id=6, message_type="train.splitfed_v2")
    trunk.busy_s += trunk_s(4, 40 * costs[1].server_flops_per_sample)  # the round's 4 steps
    garbled = trained_reply(ok, samples=40)
    del garbled.content["metrics"]["num-examples"]  # unreadable metrics: left out, no crash
    planning.observe(1, [
        (declined_for_memory(request, budget), "memory", Assignment("5", 1)),
        (trained_reply(ok, samples=40), "ok", Assignment("6", 1)),
        (garbled, "ok", Assignment("7", 1)),
    ])
    assert planning.state("5").memory_bytes == budget
    # Seconds per batch and FLOP/s, fitted to the steps before the run and the round's.
    assert planning.trunk_flops_per_s == pytest.approx(TRUNK_FLOPS)
    assert planning.costs[2].trunk_batch_s == pytest.approx(TRUNK_BATCH_S)
    assigned = planning.assign(2, [5, 6])
    assert assigned[5].cut == 1 or assigned[5].recompute  # never a plan that cannot fit
    fits = costs[assigned[5].cut].recompute_memory_bytes if assigned[5].recompute else \
        costs[assigned[5].cut].memory_bytes
    assert fits <= budget


def test_partial_work_reaches_the_straggler_and_the_planner_keeps_its_whole_round():
    """SmartSplit with min_work: every device gets the round's deadline and the least
    share of its round; after round 1 measured node 15 ten times slower, the deadline is
    shorter than its whole round, it trains what ends by it (as a device keeping the
    deadline would), and what it then reports (part of its round) does not shrink the
    workload the planner plans it with."""
    strategy, model, trunk, planning = make_splitfed(
        SmartSplitPlanner(select_fraction=1.0, exploration=0.0, straggler_penalty=0.0,
                          min_work=0.25))
    asked: dict[int, list[tuple[float, float, int]]] = {}
    trained: dict[int, list[int]] = {}

    def answer(message: Message) -> Message:
        node, data = message.metadata.dst_node_id, message.content[ROUND_KEY]
        deadline, least = float(data["deadline_s"]), float(data["min_work"])
        per_batch = (10.0 if node == 15 else 1.0) / 8
        steps = max(math.ceil(least * 8), min(8, math.floor(deadline / per_batch)))
        if message.metadata.message_type.startswith("train"):
            asked.setdefault(node, []).append((deadline, least, int(data["max_steps"])))
            trained.setdefault(node, []).append(steps)
        reply = trained_reply(message, samples=4 * steps, compute_s=per_batch * steps)
        metrics = reply.content["metrics"]
        metrics["steps"], metrics["round-examples"], metrics["round-steps"] = steps, 32, 8
        metrics["virtual-upload-s"] = metrics["virtual-download-s"] = 1e-4  # fast links
        return reply

    grid = ScriptedGrid([11, 12, 13, 14, 15], answer)
    strategy.start(grid=grid, initial_arrays=state_to_record(bottom_state(model, planning.max_cut)),
                   num_rounds=3)
    for node, records in asked.items():
        assert all(d > 0 and least == 0.25 and cap == 0 for d, least, cap in records), node
        rounds = [records[i][0] for i in range(3)]
        assert rounds == [asked[11][i][0] for i in range(3)]  # one deadline per round
    # From round 2 the deadline is shorter than the straggler's whole round (10 s), so it
    # trains its least share (2 of 8) while the others train theirs whole ...
    assert all(d < 10.0 for d, _, _ in asked[15][1:])
    assert trained[15][1:] == [2, 2] and all(trained[n][1:] == [8, 8] for n in (11, 12, 13, 14))
    # ... and what it trained by it leaves the planner's view of its round whole.
    assert planning.state("15").batches == 8 and planning.state("15").samples == 32


def test_traces_change_devices_from_their_round_on():
    phone = DeviceProfile("phone", flops_per_s=1e10, memory_bytes=1 << 30, uplink_mbps=20.0,
                          downlink_mbps=100.0, rtt_s=0.02)
    traces = [
        TraceEventConfig(from_round=3, profiles=["phone"], flops_scale=0.5),
        TraceEventConfig(from_round=5, partitions=[7], uplink_mbps=2.0, rtt_s=0.1,
                         memory_scale=0.25),
    ]
    assert apply_traces(phone, traces, partition_id=7, server_round=2) == phone
    throttled = apply_traces(phone, traces, partition_id=7, server_round=3)
    assert throttled.flops_per_s == 5e9 and throttled.uplink_mbps == 20.0
    late = apply_traces(phone, traces, partition_id=7, server_round=9)
    assert (late.flops_per_s, late.uplink_mbps, late.downlink_mbps, late.rtt_s) == (
        5e9, 2.0, 100.0, 0.1)
    assert late.memory_bytes == 1 << 28
    other = apply_traces(phone, traces, partition_id=1, server_round=9)
    assert other.uplink_mbps == 20.0 and other.flops_per_s == 5e9


@pytest.mark.parametrize(("overrides", "message"), [
    (["planner=dynsl", "strategy=ushaped", "planner.cuts=[1,4]"],
     "cut 4 leaves the trunk no stage below the device's tail cut 4"),
    (["planner=greedy", "privacy=activation_gaussian", "model=resnet", "model.cut=2",
      "planner.cuts=[2,3]"], "model=resnet at cut 2: "),
    (["planner=dynsl", "planner.cuts=[1,9]"], "planner.cuts: invalid cut 9"),
    (["planner=dynsl", "+planner.leak={7: 0.5}"], "planner.leak names cuts [7]"),
])
def test_planners_the_run_cannot_follow_are_refused_before_anything_starts(overrides, message):
    with pytest.raises(ValueError) as err:
        check_config(compose_config(overrides))
    assert message in str(err.value)


def test_activation_noise_is_checked_at_every_cut_a_planner_may_give():
    cfg = compose_config(["planner=greedy", "privacy=activation_gaussian"])
    check_config(cfg)  # the CNN's client side has no BatchNorm at any cut
    cfg.run_dir = "."
    config = to_object(cfg)
    model = build_model_from_config(config.model, config.dataset)
    assert cuts_in_play(config, model) == model.valid_cuts
    config.planner.cuts = [2, 3]
    assert cuts_in_play(config, model) == [2, 3]
    config.planner.name = "uniform"
    assert cuts_in_play(config, model) == [config.model.cut]


def test_planner_settings_are_typed_and_checked_at_composition():
    with pytest.raises(ConfigCompositionException, match="planner.evry"):
        compose_config(["planner=dynsl", "planner.evry=3"])
    with pytest.raises(ValueError, match="planner.name='fastest'"):
        PlannerConfig(name="fastest")
    with pytest.raises(ValueError, match="planner.select_fraction"):
        PlannerConfig(name="smartsplit", select_fraction=0.0)
    with pytest.raises(ValueError, match="planner.min_select_fraction"):
        PlannerConfig(name="smartsplit", select_fraction=0.5, min_select_fraction=0.7)
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="planner.min_work must be in"):
            PlannerConfig(name="smartsplit", min_work=share)
    for key in ("exploration", "straggler_penalty"):
        with pytest.raises(ValueError, match=f"planner.{key} must be >= 0"):
            PlannerConfig(name="smartsplit", **{key: -0.5})
    cfg = compose_config(["+scenario=dynamic", "planner=smartsplit"])
    assert cfg.planner.name == "smartsplit" and len(cfg.devices.traces) == 3
    check_config(cfg)


def test_global_arrays_after_a_round_hold_every_cut_a_client_may_get():
    strategy, model, trunk, planning = make_splitfed(RotatePlanner())
    grid = ScriptedGrid([11, 12], trained_reply)
    start = state_to_record(bottom_state(model, planning.max_cut))
    result = strategy.start(grid=grid, initial_arrays=start, num_rounds=2)
    final = record_to_state(result.arrays)
    assert final.keys() == bottom_state(model, planning.max_cut).keys()
    # Clients returned what they got, so the trunk's merged stages match the arrays.
    merged = trunk.stage_state()
    for key, value in final.items():
        np.testing.assert_allclose(value.numpy(), merged[key].numpy(), atol=1e-6)


def test_clients_returning_other_stages_shapes_or_non_finite_weights_are_refused():
    """An attacker holding cut 1 may not write the trunk's stages, nor poison with NaN."""
    from flwr.app import Array

    strategy, model, trunk, planning = make_splitfed(RotatePlanner())
    rows: list[dict] = []
    strategy.on_round = lambda outcome: rows.extend(outcome.rows)

    def answer(message: Message) -> Message:
        reply = trained_reply(message)
        # A copy: in this process the message shares the server's arrays.
        arrays = reply.content["arrays"] = ArrayRecord(dict(reply.content["arrays"].items()))
        node = message.metadata.dst_node_id
        if node == 12:  # also sends a stage it does not hold (the trunk's)
            arrays["3.0.weight"] = Array(np.zeros((4, 4), dtype=np.float32))
        elif node == 13:  # NaN in a stage it holds
            key = next(iter(arrays))
            arrays[key] = Array(np.full(arrays[key].shape, np.nan, dtype=np.float32))
        elif node == 14:  # a stage of the wrong shape
            key = next(iter(arrays))
            arrays[key] = Array(np.zeros((1,), dtype=np.float32))
        return reply

    before = trunk.stage_state()
    grid = ScriptedGrid([11, 12, 13, 14], answer)
    start = state_to_record(bottom_state(model, planning.max_cut))
    result = strategy.start(grid=grid, initial_arrays=start, num_rounds=1)
    status = {r["node_id"]: (r["status"], r.get("reason", "")) for r in rows}
    assert status["11"] == ("ok", "")
    assert status["12"][0] == "refused" and "not sent ['3.0.weight']" in status["12"][1]
    assert status["13"][0] == "refused" and "not finite" in status["13"][1]
    assert status["14"][0] == "refused" and "expected" in status["14"][1]
    final = record_to_state(result.arrays)
    assert all(np.isfinite(v.numpy()).all() for v in final.values())
    after = trunk.stage_state()
    # Only node 11 trained (and sent back what it got): nothing changed anywhere.
    for key, value in before.items():
        np.testing.assert_array_equal(after[key].numpy(), value.numpy())


def test_the_hosts_speed_is_its_median_step_not_one_another_process_interrupted(monkeypatch):
    from types import SimpleNamespace

    from splitlearn import calibration
    from splitlearn.calibration import client_train_flops_per_sample, measure_host_flops_per_s
    from splitlearn.models import build_model

    now = [0.0]  # the clock the measurement reads: each step advances it, nothing sleeps
    calls = []

    def step(bottom, inputs):  # noqa: ANN001, ANN202
        calls.append(1)
        now[0] += 0.3 if len(calls) == 3 else 0.002  # the second timed step is interrupted

    monkeypatch.setattr(calibration, "_train_step", step)
    monkeypatch.setattr(calibration, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    model = build_model("cnn", in_channels=1, num_classes=10, image_size=8)
    flops = measure_host_flops_per_s(model, 1, batch_size=4, min_seconds=0.31)
    step_s = client_train_flops_per_sample(model, 1) * 4 / flops
    # Six steps fill 0.31 s, so their mean is over 50 ms; the median is a 2 ms step.
    assert step_s == pytest.approx(0.002)


def test_a_trunk_step_is_timed_on_a_copy_of_the_trunks_stages():
    import torch

    from splitlearn.calibration import measure_trunk_step_s
    from splitlearn.models import build_model

    model = build_model("cnn", in_channels=1, num_classes=10, image_size=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for cut, end in ((1, None), (2, None), (1, 3)):  # end: a U-shaped trunk's last stage
        assert measure_trunk_step_s(model, cut, end=end, batch_size=4, min_seconds=0.0) > 0
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_the_planner_keeps_the_last_rounds_plans_not_one_per_round_of_the_run():
    _, _, _, planning = make_splitfed(RotatePlanner())
    for server_round in range(1, 31):
        planning.assign(server_round, [11, 12, 13])
        assert planning.plans[server_round].assignments  # the round's report reads it
        assert planning.predicted_round_s(server_round, {"11", "12", "13"}) is not None
    assert sorted(planning.plans) == list(range(31 - KEPT_PLANS, 31))
    assert len(planning.checkpoint()["plans"]) == KEPT_PLANS


def test_a_resumed_run_takes_the_trunk_steps_timed_when_it_started(monkeypatch):
    import server.app

    timed: list[int] = []
    measure = server.app.measure_trunk_step_s  # timed for real; each call recorded
    monkeypatch.setattr(server.app, "measure_trunk_step_s",
                        lambda model, cut, **kw: timed.append(cut) or measure(model, cut, **kw))
    cfg = compose_config(["planner=dynsl"])
    trunk = Trunk(build_model_from_config(cfg.model, cfg.dataset), lr=0.05)
    started = server.app.make_planning(cfg, trunk)
    assert timed == [c.cut for c in started.costs.values()] and started.trunk_steps
    saved = started.checkpoint()
    resumed = server.app.make_planning(cfg, trunk, resuming=True)
    assert resumed.trunk_steps == [] and len(timed) == len(started.costs)  # not timed again
    resumed.restore(saved)
    assert resumed.trunk_steps == started.trunk_steps
    assert resumed.trunk_flops_per_s == started.trunk_flops_per_s
