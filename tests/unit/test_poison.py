"""The poisoning suite's lying devices do what their docstrings say (experiments/poison.py)."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import Context, Message, RecordDict

from experiments.poison import (
    ATTACKS,
    ExtremeActivations,
    ExtremeGradient,
    LabelFlip,
    LyingFleet,
    Refusals,
    RunRow,
    ScaledActivations,
    ScaledGradient,
    ScaledWeights,
    SignFlippedWeights,
    SlowDrift,
    TrunkView,
    WatchedChannel,
    format_table,
    liars_of,
    protocol_for,
    write_results,
)
from protocols.splitfed import SplitFedV2Options
from server.standalone import build_trunk_side
from splitlearn.config import DataPlaneConfig, GuardConfig
from splitlearn.dataplane import InProcessTransport, TrunkRejected
from splitlearn.messages import record_to_state, state_to_record
from splitlearn.stages import split
from tests.conftest import digits_like_model, fixed_batches

CUT = 1


def trunk_side(guard: bool = True):
    dataplane = DataPlaneConfig(max_frame_bytes=1 << 22, guard=GuardConfig(enabled=guard))
    return build_trunk_side(digits_like_model("cnn"), SplitFedV2Options(lr=0.05), dataplane)


def cut_rows(n: int = 8, seed: int = 0) -> torch.Tensor:
    x, _ = fixed_batches(1, batch=n, seed=seed)[0]
    return split(digits_like_model("cnn"), CUT)[0](x).detach()


def test_every_attack_says_what_it_does_and_what_should_stop_it():
    assert len(ATTACKS) == 8
    for attack in ATTACKS.values():
        assert attack.__doc__ and attack.stopped_by
    assert [a for a, attack in ATTACKS.items() if attack.needs_device_tail] == [
        "ushaped_scaled_gradient", "ushaped_extreme_gradient"]
    assert protocol_for(ScaledGradient()) == "ushaped" and protocol_for(LabelFlip()) is None


def test_activation_attacks_stay_inside_the_fixed_bound():
    view = TrunkView(trunk_side().trunk, max_abs_value=1e6)
    rows = cut_rows()
    extreme = ExtremeActivations().activations(rows, view, device=0)
    assert torch.all(extreme == 1e6)
    assert torch.allclose(ScaledActivations(factor=10).activations(rows, view, device=0),
                          10 * rows)


def test_label_flip_maps_y_to_9_minus_y():
    assert LabelFlip().labels(torch.tensor([0, 3, 9]), 10).tolist() == [9, 6, 0]


def test_weight_attacks_scale_or_negate_float_arrays_only():
    trained = {"0.weight": torch.ones(2, 2), "0.count": torch.tensor(3)}
    received = {k: torch.zeros_like(v) for k, v in trained.items()}
    scaled = ScaledWeights(factor=10).weights(trained, received)
    flipped = SignFlippedWeights().weights(trained, received)
    assert torch.equal(scaled["0.weight"], torch.full((2, 2), 10.0))
    assert torch.equal(flipped["0.weight"], -torch.ones(2, 2))
    assert scaled["0.count"] == 3 and flipped["0.count"] == 3


def test_extreme_gradient_keeps_the_signs_at_the_fixed_bound():
    view = TrunkView(trunk_side().trunk, max_abs_value=1e5)
    grad = torch.tensor([[0.5, -0.1], [-2.0, 0.0]])
    assert ExtremeGradient().returned_gradient(grad, view).tolist() == [[1e5, -1e5],
                                                                        [-1e5, 1e5]]


def test_scaled_gradient_ascends_and_stays_just_inside_the_guards_bound():
    side = trunk_side()
    view = TrunkView(side.trunk, max_abs_value=1e6)
    tail = side.trunk.model.num_stages - 1
    grad = torch.rand(32, *side.trunk.cut_shape(tail))
    assert torch.allclose(ScaledGradient(factor=-4).returned_gradient(grad, view), -4 * grad)
    side.trunk.guard.seed("gradient", tail, grad)  # the bound is now 4 x its largest row
    side.trunk.guard.config.seed_factor = 2.0
    sent = ScaledGradient(factor=-4).returned_gradient(grad, view)
    bound = side.trunk.guard.bound("gradient", tail)
    assert float(sent.flatten(1).norm(dim=1).max()) == pytest.approx(0.95 * bound, rel=1e-5)
    assert float((sent * grad).sum()) < 0  # still the ascent direction
    side.trunk.guard.admit("liar", 1, "gradient", tail, sent)  # accepted


def test_slow_drift_grows_and_never_crosses_the_guards_bound():
    side = trunk_side()
    view = TrunkView(side.trunk, max_abs_value=1e6)
    side.trunk.guard.seed("activations", CUT, cut_rows(64))
    drift = SlowDrift(growth=1.5)
    factors = []
    for i in range(30):  # every frame admitted: the attacker reads the bound first
        rows = cut_rows(8, seed=i)
        sent = drift.activations(rows, view, device=7)
        side.trunk.guard.admit("drifter", 1, "activations", CUT, sent)
        factors.append(float(sent.norm() / rows.norm()))
    assert factors[0] == pytest.approx(1.5) and factors[3] > factors[2] > factors[1]
    assert max(factors) < 20  # capped by the bound (20 x the median), not by the growth
    assert drift.factor(cut_rows(8), view, device=8) == pytest.approx(1.5)  # per device


def test_slow_drift_without_a_guard_stops_just_inside_the_fixed_bound():
    view = TrunkView(trunk_side(guard=False).trunk, max_abs_value=100.0)
    drift = SlowDrift(growth=10.0)
    rows = cut_rows()
    for _ in range(5):
        sent = drift.activations(rows, view, device=0)
    assert float(sent.abs().max()) == pytest.approx(95.0)


def watched(side, client: str, attack=None, refusals=None) -> WatchedChannel:
    token = side.tokens.issue(client=client, protocol="splitfed_v2", cut=CUT, server_round=1,
                              ttl_s=60)
    return WatchedChannel(InProcessTransport(side.endpoint, token), attack=attack,
                          view=TrunkView(side.trunk, 1e6), device=9,
                          refusals=refusals or Refusals())


def test_a_lying_device_carries_on_after_a_refusal_until_quarantined():
    side = trunk_side()
    side.trunk.guard.seed("activations", CUT, cut_rows(64))
    refusals = Refusals()
    liar = watched(side, "liar", ExtremeActivations(), refusals)
    rows, labels = cut_rows(), torch.zeros(8, dtype=torch.int64)
    for _ in range(2):  # refused, but the liar gets zeros back and goes on
        grad, loss, correct = liar.forward(rows, labels)
        assert torch.equal(grad, torch.zeros_like(rows)) and correct == 0
    with pytest.raises(TrunkRejected, match="quarantined"):
        liar.forward(rows, labels)
    assert refusals.of("attacker") == {"OUT_OF_RANGE": 2, "QUARANTINED": 1}
    honest = watched(side, "honest", refusals=refusals)
    honest.forward(rows, labels)  # the others carry on
    assert refusals.of("honest") == {}


def test_an_honest_device_stops_at_its_first_refusal_and_it_is_counted():
    side = trunk_side()
    side.trunk.guard.seed("activations", CUT, cut_rows(64))
    refusals = Refusals()
    honest = watched(side, "honest", refusals=refusals)
    with pytest.raises(TrunkRejected):
        honest.forward(torch.full_like(cut_rows(), 1e5), torch.zeros(8, dtype=torch.int64))
    assert refusals.of("honest") == {"OUT_OF_RANGE": 1}


class FixedReply:
    """A ClientApp stand-in that answers a train message with given weights."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def __call__(self, message: Message, context: Context) -> Message:
        content = RecordDict({"arrays": state_to_record(self.state)})
        return Message(content=content, reply_to=message)


@pytest.mark.usefixtures("task_identity")
def test_the_fleet_lies_only_on_the_liars_partitions():
    trained = {"0.weight": torch.ones(3)}
    app = FixedReply(trained)
    fleet = LyingFleet(app, app, attack=ScaledWeights(factor=10), liars=liars_of(1, 10))

    def reply(partition: int) -> dict[str, torch.Tensor]:
        message = Message(RecordDict({"arrays": state_to_record({"0.weight": torch.zeros(3)})}),
                          dst_node_id=partition + 1, message_type="train.splitfed_v2")
        context = Context(run_id=1, node_id=partition + 1, node_config={
            "partition-id": partition, "num-partitions": 10}, state=RecordDict(), run_config={})
        return record_to_state(fleet(message, context).content["arrays"])

    assert torch.equal(reply(3)["0.weight"], torch.ones(3))
    assert torch.equal(reply(9)["0.weight"], torch.full((3,), 10.0))


def test_the_results_are_written_as_a_table_csv_json_and_plot(tmp_path):
    rows = [RunRow("none", "splitfed_v2", 0, on, 0.97, 0.0) for on in ("on", "off")]
    rows += [RunRow("label_flip", "splitfed_v2", 1, "on", 0.96, -0.01, quarantined=3,
                    attacker_refused={"OUT_OF_RANGE": 6, "QUARANTINED": 3}),
             RunRow("label_flip", "splitfed_v2", 1, "off", 0.40, -0.57, shortened=4,
                    honest_refused={"STEP_NOT_FINITE": 2})]
    write_results(rows, tmp_path, footer="digits")
    table = (tmp_path / "poison.md").read_text()
    row = "| label_flip | splitfed_v2 | 1 | off | 0.400 | -57.0 pts | 0 | 4 | STEP_NOT_FINITE:2 |"
    assert row in table and table.endswith("digits\n")
    assert table.startswith(format_table(rows))
    assert json.loads((tmp_path / "poison.json").read_text())[2]["quarantined"] == 3
    assert "OUT_OF_RANGE:6 QUARANTINED:3" in (tmp_path / "poison.csv").read_text()
    assert (tmp_path / "poison.png").stat().st_size > 0


def test_seconds_per_round_leave_the_first_round_out():
    from experiments.poison import seconds_per_round

    assert seconds_per_round([0.0, 10.0, 12.0, 15.0, 17.0]) == 2.0  # rounds 2+: 2, 3, 2


def test_the_step_cost_table_names_each_setting():
    from experiments.poison import measure_step_cost

    table = measure_step_cost(repeats=1, steps=3)
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:]] == [
        "guard off", "no loss check", "defaults"]
