"""Robust aggregation of the device side: every statistic against a slow reference or Flower's
own helpers, the bound on claimed examples, the refusals, and what a round reports."""

from __future__ import annotations

import copy
import statistics

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy.bulyan import aggregate_n_closest_weights
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
from flwr.serverapp.strategy.multikrum import select_multikrum
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from protocols import check_config, compose_config
from server.sessions.split import SharedTrunk, SplitSession, train_on_batch
from server.trunk import Trunk
from splitlearn.config import AggregationConfig, DataPlaneConfig, RunSpec
from splitlearn.dataplane import TokenRegistry
from splitlearn.merge import stage_of
from splitlearn.messages import record_to_state, state_to_record, with_dtypes_of
from splitlearn.robust import RobustRule, bound_claims, bound_updates, robust_blocks
from splitlearn.stages import bottom_state
from strategies.reporting import ReportingFedAvg, RoundOutcome
from strategies.splitfed import DataPlaneAccess, SplitFed
from tests.conftest import digits_like_model, fixed_batches
from tests.helpers import ScriptedGrid, plain_spec

pytestmark = pytest.mark.usefixtures("task_identity")

SHAPES = {0: (2, 3), 1: (4,), 2: (3, 2)}  # one array per stage, small


def reply(node: int, state: dict[str, Tensor], examples: float) -> Message:
    """A finished device's reply: its arrays and its claimed examples."""
    content = RecordDict({"arrays": state_to_record(state), "metrics": MetricRecord(
        {"num-examples": examples, "partition-id": node - 1})})
    request = Message(content=RecordDict(), dst_node_id=node, message_type="train.any")
    return Message(content=content, reply_to=request)


def copies_at_cuts(cuts: list[int], seed: int) -> list[dict[str, Tensor]]:
    """A copy per device holding the stages below its cut, random values."""
    generator = torch.Generator().manual_seed(seed)
    return [{f"{s}.w": torch.randn(SHAPES[s], generator=generator) for s in range(cut)}
            for cut in cuts]


def per_coordinate(values: list[Tensor], statistic) -> Tensor:  # noqa: ANN001
    """Slow and obvious: ``statistic`` of every coordinate's list of floats."""
    stacked = torch.stack(values).double()
    flat = stacked.reshape(len(values), -1)
    out = [statistic(sorted(flat[:, j].tolist())) for j in range(flat.shape[1])]
    return torch.tensor(out, dtype=torch.float64).reshape(values[0].shape)


def slow_trimmed(cut: int):  # noqa: ANN201
    return lambda ordered: statistics.fmean(ordered[cut:len(ordered) - cut])


# --- each statistic against a reference --------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(1, 3), min_size=1, max_size=7), seed=st.integers(0, 2**16),
       method=st.sampled_from(["median", "trimmed_mean"]),
       fraction=st.sampled_from([0.1, 0.2, 0.34, 0.45]))
def test_per_stage_median_and_trimmed_mean_equal_a_per_coordinate_reference(
        cuts, seed, method, fraction):
    copies = copies_at_cuts(cuts, seed)
    rule = RobustRule(method, num_malicious=0, trim_fraction=fraction)
    blocks = {b.keys: b for b in robust_blocks([(c, 1.0) for c in copies], rule)}
    for stage in range(max(cuts)):
        key = f"{stage}.w"
        holders = [c[key] for c in copies if key in c]
        [block] = [b for keys, b in blocks.items() if key in keys]
        assert block.holders == tuple(i for i, c in enumerate(copies) if key in c)
        if len(holders) < rule.least_copies():  # too few for the rule: held, not averaged
            assert block.held is not None and block.weight == 0
            continue
        cut = int(fraction * len(holders))
        reference = per_coordinate(holders, statistics.median if method == "median"
                                   else slow_trimmed(cut))
        assert torch.allclose(block.state[key].double(), reference, atol=1e-6), key
        assert block.state[key].dtype == torch.float32


def test_trimmed_mean_needs_at_least_one_copy_cut_and_at_least_f():
    assert RobustRule("trimmed_mean", num_malicious=0, trim_fraction=0.2).least_copies() == 5
    assert RobustRule("trimmed_mean", num_malicious=2, trim_fraction=0.2).least_copies() == 10
    assert RobustRule("median", num_malicious=2).least_copies() == 5
    assert RobustRule("krum", num_malicious=1).least_copies() == 5
    assert RobustRule("bulyan", num_malicious=1).least_copies() == 7


def flat_records(copies: list[dict[str, Tensor]]) -> list[RecordDict]:
    return [RecordDict({"arrays": state_to_record(c), "metrics": MetricRecord(
        {"num-examples": 1})}) for c in copies]


@pytest.mark.parametrize("seed", range(3))
def test_one_block_is_flowers_own_krum_multikrum_trimmed_mean_and_bulyan(seed):
    """With one cut for all, the whole device side is one block: Flower's definitions."""
    copies = copies_at_cuts([3] * 9, seed)
    updates = [(c, 1.0) for c in copies]
    records = flat_records(copies)
    f = 2
    for method, count in (("krum", 1), ("multi_krum", 9 - f)):
        [block] = robust_blocks(updates, RobustRule(method, num_malicious=f))
        chosen = select_multikrum(records, num_malicious_nodes=f, num_nodes_to_select=count)
        assert {records.index(r) for r in chosen} == set(block.kept)
    [block] = robust_blocks(updates, RobustRule("trimmed_mean", num_malicious=1,
                                                trim_fraction=0.3))
    for key, value in block.state.items():
        flower = trim_mean(np.stack([c[key].numpy() for c in copies]), 0.3)
        np.testing.assert_allclose(value.numpy(), flower, rtol=1e-6, atol=1e-7)
    [block] = robust_blocks(updates, RobustRule("bulyan", num_malicious=f - 1))
    theta = 9 - 2 * (f - 1)
    selected = select_multikrum(records, f - 1, theta)
    arrays = [[r["arrays"][k].numpy() for k in copies[0]] for r in selected]
    medians = [np.median(np.stack(layer), axis=0) for layer in zip(*arrays, strict=True)]
    flower = aggregate_n_closest_weights(medians, arrays, theta - 2 * (f - 1))
    assert {records.index(r) for r in selected} == set(block.kept)
    for key, want in zip(copies[0], flower, strict=True):
        np.testing.assert_allclose(block.state[key].numpy(), want, rtol=1e-6, atol=1e-7)


def honest_and_one(attack: float, seed: int = 0) -> list[dict[str, Tensor]]:
    """Five copies near one point; the last multiplied by ``attack``."""
    generator = torch.Generator().manual_seed(seed)
    base = {f"{s}.w": torch.randn(SHAPES[s], generator=generator) for s in SHAPES}
    copies = [{k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in base.items()}
              for _ in range(5)]
    copies[-1] = {k: v * attack for k, v in copies[-1].items()}
    return copies


@pytest.mark.parametrize("attack", [100.0, -1.0])
@pytest.mark.parametrize("method", ["krum", "multi_krum", "bulyan"])
def test_a_selecting_method_leaves_out_a_scaled_or_sign_flipped_copy(attack, method):
    copies = honest_and_one(attack)
    if method == "bulyan":  # n >= 4f + 3: two more honest copies
        copies = honest_and_one(attack)[:4] + honest_and_one(1.0, seed=0)[:2] + copies[-1:]
    [block] = robust_blocks([(c, 10.0) for c in copies], RobustRule(method, num_malicious=1))
    assert len(copies) - 1 not in block.kept
    if method == "krum":
        [kept] = block.kept
        assert all(torch.equal(block.state[k], copies[kept][k]) for k in copies[kept])


# --- the bound on claimed examples ---------------------------------------------------------


def test_claims_within_the_bound_are_left_exactly_as_they_are():
    claims = [30, 100, 75.5, 40]  # the lower median is 40
    assert bound_claims(claims, 10.0) == claims
    assert all(a is b for a, b in zip(bound_claims(claims, 10.0), claims, strict=True))
    assert bound_claims([1e9, 100, 100, 100, 100], 10.0) == [1000.0, 100, 100, 100, 100]
    assert bound_claims([1e9, 100], 2.0) == [200.0, 100]  # the lower median: the honest one
    assert bound_claims([1e9, 100], 0.0) == [1e9, 100]  # 0: unbounded


@pytest.mark.parametrize("ratio", [1.0, 4.0, 10.0])
def test_one_device_claiming_a_billion_examples_moves_the_average_no_further_than_the_bound(
        ratio):
    honest = [reply(n, {"0.w": torch.zeros(2, 3)}, 100) for n in (1, 2, 3, 4)]
    liar = reply(5, {"0.w": torch.ones(2, 3)}, 1e9)
    outcomes: list[RoundOutcome] = []
    strategy = ReportingFedAvg(protocol="any", spec=RunSpec(), on_round=outcomes.append,
                               aggregation=AggregationConfig(max_examples_ratio=ratio))
    arrays, metrics = strategy.aggregate_train(1, [*honest, liar])
    share = ratio * 100 / (ratio * 100 + 4 * 100)  # the liar counts as ratio x the median
    np.testing.assert_allclose(arrays["0.w"].numpy(), share, rtol=1e-6)
    assert metrics["examples-capped"] == 1
    assert metrics["num-examples"] == 4 * 100 + ratio * 100  # counted, not claimed
    [outcome] = outcomes
    assert {r["client"]: r.get("examples_counted") for r in outcome.rows}["4"] == ratio * 100
    unbounded = ReportingFedAvg(protocol="any", spec=RunSpec(),
                                aggregation=AggregationConfig(max_examples_ratio=0))
    arrays, _ = unbounded.aggregate_train(1, [*honest, liar])
    assert arrays["0.w"].numpy().min() > 0.999  # what the bound prevents


def test_the_rounds_train_metrics_weigh_a_capped_claim_as_counted():
    # The liar's loss would be the round's train loss if its claim weighed it.
    def with_loss(message: Message, loss: float) -> Message:
        message.content["metrics"]["train-loss"] = loss
        return message

    honest = [with_loss(reply(n, {"0.w": torch.zeros(2, 3)}, 100), 0.5) for n in (1, 2, 3, 4)]
    liar = with_loss(reply(5, {"0.w": torch.ones(2, 3)}, 1e9), 50.0)
    strategy = ReportingFedAvg(protocol="any", spec=RunSpec(),
                               aggregation=AggregationConfig(max_examples_ratio=1.0))
    _, metrics = strategy.aggregate_train(1, [*honest, liar])
    assert metrics["train-loss"] == pytest.approx((4 * 0.5 + 50.0) / 5)  # the liar as 100
    unbounded = ReportingFedAvg(protocol="any", spec=RunSpec(),
                                aggregation=AggregationConfig(max_examples_ratio=0))
    _, metrics = unbounded.aggregate_train(1, [*honest, liar])
    assert metrics["train-loss"] > 49.9  # what the bound prevents


# --- the default path is today's, to the bit -------------------------------------------------


class RecordingTrunk:
    """A trunk side that records what the strategy merges and returns the first copy."""

    def __init__(self) -> None:
        self.merged: list[list[tuple[dict[str, Tensor], int]]] = []

    def finish_round(self, finished) -> None:  # noqa: ANN001
        """Nothing to settle."""

    def merge_round(self, updates, *, upto: int) -> dict[str, Tensor]:  # noqa: ANN001
        self.merged.append(list(updates))
        return dict(updates[0][0])


def split_strategy(trunk: object, aggregation: AggregationConfig | None) -> SplitFed:
    return SplitFed(protocol="any", spec=plain_spec(0.05), min_available_nodes=1,
                    min_train_nodes=1, trunk=trunk, aggregation=aggregation,
                    dataplane=DataPlaneAccess(TokenRegistry(), "127.0.0.1:1", 60.0))


def test_with_robust_none_the_merge_is_bit_identical_to_the_unbounded_weighted_mean():
    copies = copies_at_cuts([3, 3, 3, 3], seed=7)
    claims = [13, 250, 64, 31]  # unequal, all within 10x the median
    replies = [reply(i + 1, c, n) for i, (c, n) in enumerate(zip(copies, claims, strict=True))]
    default = ReportingFedAvg(protocol="any", spec=RunSpec(), aggregation=AggregationConfig())
    flower = with_dtypes_of(aggregate_arrayrecords([r.content for r in replies], "num-examples"),
                            replies[0].content["arrays"])
    arrays, metrics = default.aggregate_train(1, replies)
    for key in flower:
        assert np.array_equal(arrays[key].numpy(), flower[key].numpy()), key
    assert metrics["examples-capped"] == 0 and "robust-held" not in metrics
    # SplitFed: the trunk's merge gets the very same copies and sample counts.
    seen = []
    for aggregation in (None, AggregationConfig()):
        trunk = RecordingTrunk()
        split_strategy(trunk, aggregation).aggregate_arrays(1, replies)
        seen.append(trunk.merged[0])
    for (a, n), (b, m) in zip(*seen, strict=True):
        assert n == m and type(n) is type(m) is int
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_split_merge_gets_the_bounded_claim():
    replies = [reply(n, {"0.w": torch.zeros(2)}, 50) for n in (1, 2, 3)]
    replies.append(reply(4, {"0.w": torch.ones(2)}, 10**9))
    trunk = RecordingTrunk()
    split_strategy(trunk, AggregationConfig(max_examples_ratio=4)).aggregate_arrays(1, replies)
    assert [n for _, n in trunk.merged[0]] == [50, 50, 50, 200]


# --- per-client cuts: the devices' copies robustly, the trunk's as it is --------------------


def acts_at(model, cut: int, seed: int, batch: int) -> tuple[Tensor, Tensor]:  # noqa: ANN001
    x, y = fixed_batches(1, batch=batch, seed=seed)[0]
    with torch.no_grad():
        for stage in model.stages[:cut]:
            x = stage(x)
    return x, y


def per_client_cut_round(method: str):  # noqa: ANN201
    """Devices at cuts 1, 3, 3, 3 (the last poisoned x100) and a shared trunk that trained."""
    model = digits_like_model()
    trunk = Trunk(copy.deepcopy(model), lr=0.1)
    before = trunk.stage_state()
    train_on_batch(trunk, 1, *acts_at(model, 1, 1, 8))  # for the device at cut 1
    train_on_batch(trunk, 3, *acts_at(model, 3, 2, 24))  # for the devices at cut 3
    trunk_state, books = trunk.stage_state(), list(trunk.stage_samples)
    generator = torch.Generator().manual_seed(3)
    cuts, claims = [1, 3, 3, 3], [8, 24, 16, 32]
    copies = [{k: v + 0.01 * torch.randn(v.shape, generator=generator)
               for k, v in bottom_state(model, cut).items()} for cut in cuts]
    copies[-1] = {k: v * 100 if v.dtype.is_floating_point else v for k, v in copies[-1].items()}
    replies = [reply(i + 1, c, n) for i, (c, n) in enumerate(zip(copies, claims, strict=True))]
    session = SplitSession(SharedTrunk(trunk), dataplane=DataPlaneConfig())
    strategy = split_strategy(session, AggregationConfig(robust=method, num_malicious=1))
    strategy.global_cut = 3
    merged = record_to_state(strategy.aggregate_arrays(1, replies))
    return merged, copies, claims, trunk_state, books, before


def test_per_client_cuts_take_the_median_of_each_stages_device_copies_beside_the_trunks():
    merged, copies, claims, trunk_state, books, _ = per_client_cut_round("median")
    assert books == [0, 8, 8, 32, 32]
    for key, value in merged.items():
        stage = stage_of(key)
        holders = [i for i, c in enumerate(copies) if key in c]
        assert holders == ([0, 1, 2, 3] if stage == 0 else [1, 2, 3])
        median = per_coordinate([copies[i][key] for i in holders], statistics.median)
        devices = sum(claims[i] for i in holders)  # the device side keeps its plain share
        expected = (devices * median + books[stage] * trunk_state[key].double()) / (
            devices + books[stage])
        assert torch.allclose(value.double(), expected, atol=1e-5), key
        poisoned = copies[3][key]
        assert not torch.allclose(value, poisoned, rtol=0.5)  # the x100 copy did not win


def test_stages_with_too_few_copies_for_the_rule_keep_the_trunks_weights():
    """Krum with f = 1 needs 5 copies; 4 and 3 hold each stage: every block is held."""
    merged, _, _, trunk_state, books, before = per_client_cut_round("krum")
    for key, value in merged.items():
        # Stage 0 nobody but the devices trained: its previous weights. Stages 1-2: the
        # trunk trained them too, and its copy alone counts.
        want = before[key] if books[stage_of(key)] == 0 else trunk_state[key]
        assert torch.equal(value, want), key


def test_a_round_with_too_few_devices_keeps_the_previous_weights_and_says_so():
    start = {"0.w": torch.zeros(2, 3), "1.w": torch.zeros(4)}

    def answer(message: Message) -> Message:
        node = message.metadata.dst_node_id
        sent = record_to_state(message.content["arrays"])
        return Message(content=reply(node, {k: v + node for k, v in sent.items()},
                                     10).content, reply_to=message)

    outcomes: list[RoundOutcome] = []
    seen: dict[int, dict[str, np.ndarray]] = {}
    strategy = ReportingFedAvg(protocol="any", spec=RunSpec(), on_round=outcomes.append,
                               min_available_nodes=1, min_train_nodes=1, fraction_evaluate=0.0,
                               aggregation=AggregationConfig(robust="krum", num_malicious=1))
    strategy.start(grid=ScriptedGrid([1, 2, 3], answer), initial_arrays=state_to_record(start),
                   num_rounds=1, evaluate_fn=lambda r, a: seen.update(
                       {r: {k: v.numpy() for k, v in a.items()}}))
    assert all(np.array_equal(seen[1][k], start[k].numpy()) for k in start)
    [outcome] = outcomes
    assert outcome.metrics["robust_held"] == 1 and outcome.metrics["robust_left_out"] == 0


def test_the_round_reports_which_devices_krum_left_out():
    copies = honest_and_one(100.0)
    outcomes: list[RoundOutcome] = []
    strategy = ReportingFedAvg(protocol="any", spec=RunSpec(), on_round=outcomes.append,
                               aggregation=AggregationConfig(robust="multi_krum"))
    arrays, metrics = strategy.aggregate_train(
        1, [reply(i + 1, c, 10) for i, c in enumerate(copies)])
    assert metrics["robust-left-out"] == 1 and metrics["robust-held"] == 0
    [outcome] = outcomes
    assert {r["client"]: r["robust_left_out"] for r in outcome.rows} == {
        "0": 0, "1": 0, "2": 0, "3": 0, "4": 1}
    honest = {k: torch.stack([c[k] for c in copies[:4]]).mean(0) for k in copies[0]}
    for key, value in honest.items():
        np.testing.assert_allclose(arrays[key].numpy(), value.numpy(), rtol=1e-5)


def test_local_loss_takes_the_median_of_the_stages_and_of_each_cuts_heads():
    """The heads are trained on the devices only: the rule aggregates them too."""
    from protocols.local_loss import LocalLossOptions
    from strategies.local_loss import LocalLossSplit

    generator = torch.Generator().manual_seed(5)
    copies = [{"0.w": torch.randn(2, 3, generator=generator),
               "aux.1.weight": torch.randn(10, 4, generator=generator)} for _ in range(3)]
    copies[2] = {k: v * -1000 for k, v in copies[2].items()}  # the liar: stage and head
    trunk = RecordingTrunk()
    strategy = LocalLossSplit(
        protocol="any", spec=RunSpec(strategy=LocalLossOptions()), trunk=trunk,
        dataplane=DataPlaneAccess(TokenRegistry(), "127.0.0.1:1", 60.0),
        aggregation=AggregationConfig(robust="median", num_malicious=1))
    arrays, metrics = strategy.aggregate_train(
        1, [reply(n + 1, c, 10 * (n + 1)) for n, c in enumerate(copies)])
    [(stage, weight)] = trunk.merged[0]  # one block for the devices' stages, all their examples
    assert weight == 60
    assert torch.allclose(stage["0.w"].double(),
                          per_coordinate([c["0.w"] for c in copies], statistics.median))
    head = per_coordinate([c["aux.1.weight"] for c in copies], statistics.median)
    np.testing.assert_allclose(arrays["aux@1.1.weight"].numpy(), head.numpy(), rtol=1e-6)
    assert metrics["robust-held"] == 0


# --- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "names"), [
    (["aggregation.robust=median", "aggregation.secure=true"],
     ["aggregation.robust=median", "aggregation.secure=true"]),
    (["aggregation.robust=krum", "aggregation.update_clip_norm=1",
      "aggregation.update_noise_multiplier=1"],
     ["aggregation.robust=krum", "aggregation.update_noise_multiplier"]),
    (["aggregation.robust=median", "strategy=sequential"],
     ["aggregation.robust=median", "strategy=sequential"]),
    (["aggregation.robust=krum", "num_clients=4"], ["aggregation.num_malicious=1", "at least 5"]),
    (["aggregation.robust=bulyan", "num_clients=10", "strategy.fraction_train=0.5"],
     ["aggregation.num_malicious=1", "at least 7"]),
    (["aggregation.robust=multi_krum", "aggregation.multi_krum_selected=10"],
     ["aggregation.multi_krum_selected=10"]),
    (["aggregation.robust=fedmean"], ["aggregation.robust='fedmean'"]),
    (["aggregation.trim_fraction=0.5"], ["aggregation.trim_fraction"]),
    (["aggregation.max_examples_ratio=0.5"], ["aggregation.max_examples_ratio"]),
])
def test_a_robust_rule_that_cannot_hold_is_refused_naming_the_keys(overrides, names):
    with pytest.raises(ValueError) as refused:
        check_config(compose_config(overrides))
    for name in names:
        assert name in str(refused.value)


@pytest.mark.parametrize("overrides", [
    ["aggregation.robust=median", "num_clients=3"],
    ["aggregation.robust=krum", "num_clients=5", "strategy=fedavg"],
    ["aggregation.robust=trimmed_mean", "aggregation.update_clip_norm=1"],  # clipping alone
    ["aggregation.robust=bulyan", "aggregation.num_malicious=0", "num_clients=3"],
])
def test_a_robust_rule_whose_assumption_holds_is_accepted(overrides):
    check_config(compose_config(overrides))


# --- the bound on each device's update --------------------------------------------------------


def round_of(updates: list[dict[str, Tensor]], seed: int = 0
             ) -> tuple[list[dict[str, Tensor]], list[dict[str, Tensor]]]:
    """What each device was given (the same weights) and its state after ``updates``."""
    generator = torch.Generator().manual_seed(seed)
    given = {"0.0.weight": torch.randn(3, 2, generator=generator),
             "0.0.bias": torch.randn(3, generator=generator),
             "0.1.num_batches_tracked": torch.tensor(5)}
    states = [{k: v + update.get(k, 0) if v.is_floating_point() else v + 1
               for k, v in given.items()} for update in updates]
    return [given] * len(updates), states


def update_norm(state: dict[str, Tensor], given: dict[str, Tensor], module: str) -> float:
    return float(torch.cat([(state[k] - given[k]).flatten() for k in state
                            if k.rpartition(".")[0] == module and state[k].is_floating_point()
                            ]).norm())


def test_updates_within_the_bound_are_left_exactly_as_they_are():
    generator = torch.Generator().manual_seed(1)
    updates = [{"0.0.weight": 0.1 * torch.randn(3, 2, generator=generator)} for _ in range(5)]
    given, states = round_of(updates)
    bounded, shortened = bound_updates(states, given, 4.0)
    assert shortened == [0] * 5
    assert all(bounded[i][k] is states[i][k] for i in range(5) for k in states[i])
    assert bound_updates(states, given, 0.0)[1] == [0] * 5  # 0: unbounded


@pytest.mark.parametrize("factor", [10.0, -1.0, -10.0])
def test_scaled_or_negated_weights_are_shortened_to_the_bound_keeping_their_direction(factor):
    """The attacks of ``experiments.attack poison``: the trained weights times ``factor``."""
    generator = torch.Generator().manual_seed(2)
    updates = [{"0.0.weight": 0.1 * torch.randn(3, 2, generator=generator),
                "0.0.bias": 0.1 * torch.randn(3, generator=generator)} for _ in range(5)]
    given, states = round_of(updates)
    liar = {k: factor * v if v.is_floating_point() else v for k, v in states[0].items()}
    honest = [update_norm(s, given[0], "0.0") for s in states[1:]]
    bounded, shortened = bound_updates([liar, *states[1:]], given, 2.0)
    median = sorted([update_norm(liar, given[0], "0.0"), *honest])[2]
    assert shortened == [1, 0, 0, 0, 0]
    assert update_norm(bounded[0], given[0], "0.0") == pytest.approx(2.0 * median, rel=1e-5)
    direction = torch.nn.functional.cosine_similarity(
        (bounded[0]["0.0.weight"] - given[0]["0.0.weight"]).flatten(),
        (liar["0.0.weight"] - given[0]["0.0.weight"]).flatten(), dim=0)
    assert float(direction) == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(bounded[0]["0.1.num_batches_tracked"], liar["0.1.num_batches_tracked"])


@settings(max_examples=60, deadline=None)
@given(scales=st.lists(st.floats(0.0, 1e4), min_size=1, max_size=9),
       ratio=st.sampled_from([1.0, 2.0, 4.0]), seed=st.integers(0, 2**16),
       cuts=st.lists(st.integers(1, 3), min_size=9, max_size=9))
def test_no_update_of_a_module_exceeds_the_bound_over_its_holders(scales, ratio, seed, cuts):
    """Per module, over the devices holding it (per-client cuts): every shortened update
    is at ratio x the lower median of the holders' update norms, the others untouched."""
    copies = copies_at_cuts(cuts[:len(scales)], seed)
    given = copies_at_cuts(cuts[:len(scales)], seed + 1)
    states = [{k: g[k] + s * (c[k] - g[k]) for k in c}
              for c, g, s in zip(copies, given, scales, strict=True)]
    bounded, shortened = bound_updates(states, given, ratio)
    for stage in range(3):
        key = f"{stage}.w"
        holders = [i for i, s in enumerate(states) if key in s]
        if not holders:
            continue
        norms = [float((states[i][key] - given[i][key]).norm()) for i in holders]
        bound = ratio * sorted(norms)[(len(norms) - 1) // 2]
        for i, norm in zip(holders, norms, strict=True):
            after = float((bounded[i][key] - given[i][key]).norm())
            if bound > 0 and norm > bound:  # up to float32's rounding of given + update
                rounding = 1e-6 * float(given[i][key].abs().max())
                assert after == pytest.approx(bound, rel=1e-4, abs=rounding)
            else:
                assert bounded[i][key] is states[i][key]
    assert sum(shortened) == sum(
        1 for i, s in enumerate(states) for k in s if bounded[i][k] is not s[k])


def test_the_strategy_bounds_each_update_against_what_the_device_was_given():
    """Through configure_train and aggregate_train, as a run does: one device scales its
    weights x10; the average stays within the bound of the honest ones, and its row says so."""
    given = {"0.w": torch.ones(2, 3)}
    outcomes: list[RoundOutcome] = []
    strategy = ReportingFedAvg(protocol="any", spec=RunSpec(), on_round=outcomes.append,
                               aggregation=AggregationConfig(max_update_ratio=2.0),
                               min_available_nodes=5, min_train_nodes=5)
    grid = ScriptedGrid([1, 2, 3, 4, 5], answer=lambda m: m)
    sent = list(strategy.configure_train(1, state_to_record(given), ConfigRecord(), grid))
    assert len(sent) == 5
    updates = {1: 0.1, 2: 0.12, 3: 0.08, 4: 0.11, 5: 9.0}  # 5: ones x 10
    replies = []
    for message in sent:
        node = message.metadata.dst_node_id
        content = RecordDict({"arrays": state_to_record({"0.w": given["0.w"] + updates[node]}),
                              "metrics": MetricRecord({"num-examples": 100,
                                                       "partition-id": node - 1})})
        replies.append(Message(content=content, reply_to=message))
    arrays, metrics = strategy.aggregate_train(1, replies)
    liar = 2.0 * 0.11  # shortened to 2 x the lower median update (0.11 per entry)
    expected = 1.0 + (0.1 + 0.12 + 0.08 + 0.11 + liar) / 5
    np.testing.assert_allclose(arrays["0.w"].numpy(), expected, rtol=1e-5)
    assert metrics["updates-shortened"] == 1
    [outcome] = outcomes
    assert {r["node_id"]: r.get("update_shortened") for r in outcome.rows}["5"] == 1
