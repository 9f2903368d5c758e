"""Whole runs of the shipped apps in one process (``experiments.local``), a few seconds each.

The strategy, ClientApp, client loop and trunk are the deployed ones; only the engine
is local (clients in threads, the in-process channel).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from experiments.local import LocalGrid, run_local
from splitlearn.config import DatasetConfig
from splitlearn.data import held_out_dataset
from splitlearn.evaluation import evaluate_model
from tests.conftest import small_config
from tests.integration.test_adaptive_splits import ROTATING, cuts_by_round
from tests.integration.test_simulation import read_clients
from tests.user_nets import TinyNet

TARGET = "tests.user_nets.TinyNet"


def test_a_run_trains_the_users_module_and_hands_back_its_state_dict(tmp_path):
    cfg = small_config(f"model._target_={TARGET}", "model.cut=1", "+model.options.hidden=24",
                       run_dir=str(tmp_path))
    result = run_local(cfg, concurrency=2)
    history = result.history
    assert history[-1]["test_accuracy"] > history[0]["test_accuracy"] + 0.2
    state = torch.load(tmp_path / "model.pt")
    mine = TinyNet(hidden=24)
    mine.load_state_dict(state)  # the original module's keys, strictly
    # The module the user gets back is the model the run evaluated last.
    loader = DataLoader(held_out_dataset(DatasetConfig(), seed=cfg.seed), batch_size=512)
    _, accuracy, _ = evaluate_model(mine, loader)
    assert accuracy == pytest.approx(history[-1]["test_accuracy"])


@pytest.mark.parametrize("planner", [(), ("planner=rotate", "planner.cuts=[1,2,3]")],
                         ids=["one-cut", "per-client-cuts"])
def test_with_one_client_per_step_sglr_is_splitfed_v2(planner):
    """One client in each step: scale 1, the average of one gradient is its own. With
    per-client cuts too (cuts differ within a round and move), SGLR merges per stage as
    SplitFed v2 does."""
    histories = {
        name: run_local(small_config(f"strategy={name}", "strategy.momentum=0", *planner),
                        concurrency=1).history
        for name in ("sglr", "splitfed_v2")
    }
    for a, b in zip(histories["sglr"], histories["splitfed_v2"], strict=True):
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-6)
        assert a["test_accuracy"] == b["test_accuracy"]


def test_ushaped_with_moving_cuts_and_one_client_is_splitfed_v2():
    """One client, plain SGD, its cut moving every round (1, 2, 3): the U-shaped tail on the
    device and the trunk's middle train what SplitFed v2's trunk trains, batch by batch, so
    both are whole-model SGD; any stage lost or mis-weighted when the cut moves differs."""
    rotating = ("planner=rotate", "planner.cuts=[1,2,3]", "num_clients=1",
                "strategy.min_train_nodes=1", "strategy.num_rounds=3", "strategy.momentum=0")
    histories = {
        name: run_local(small_config(f"strategy={name}", *rotating), concurrency=1).history
        for name in ("ushaped", "splitfed_v2")
    }
    for a, b in zip(histories["ushaped"], histories["splitfed_v2"], strict=True):
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-5)
    assert histories["ushaped"][-1]["test_accuracy"] > histories["ushaped"][0]["test_accuracy"]


@pytest.mark.parametrize("bulk", ["true", "false"], ids=["bulk", "streamed"])
def test_local_loss_trains_with_different_and_moving_cuts(tmp_path, caplog, bulk):
    """Clients at cuts 1, 2 and 3 in one round, each cut moving every round: each client
    trains its cut's head, the trunk trains every batch from the cut it came from (a
    batch checked against another cut is refused), and every stage is merged over the
    copies that trained it, so the joined model learns (chance is 0.1; with one cut for
    all, these 5 rounds end at 0.69 bulk and 0.88 streamed, moving cuts at 0.72 and, streamed,
    0.52-0.78 with a best round of 0.59-0.65: two clients stream at once, so the order in
    which the trunk trains their batches, and the accuracy, varies from run to run)."""
    cfg = small_config("strategy=local_loss", f"strategy.bulk={bulk}", "strategy.num_rounds=5",
                       *ROTATING, run_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING):
        history = run_local(cfg, concurrency=2).history
    assert not [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    cuts = cuts_by_round(read_clients(tmp_path))
    assert all(set(cuts[str(r)].values()) == {1, 2, 3} for r in range(1, 6))
    assert cuts["1"] != cuts["2"]  # the cuts moved
    assert max(r["test_accuracy"] for r in history) > 0.45 and history[-1]["test_accuracy"] > 0.4


def test_local_loss_with_a_planner_at_one_cut_is_local_loss():
    """The per-client machinery (a head per cut, the per-stage merge) at one cut for all
    reduces to local loss without a planner, to the bit."""
    histories = [
        run_local(small_config("strategy=local_loss", "strategy.bulk=true", "model.cut=2",
                               *planner), concurrency=1).history
        for planner in ((), ("planner=rotate", "planner.cuts=[2]"))
    ]
    for a, b in zip(*histories, strict=True):
        assert a["test_loss"] == b["test_loss"] and a["test_accuracy"] == b["test_accuracy"]


def test_sequential_with_different_and_moving_cuts_is_sequential_at_one_cut():
    """Plain SGD on both sides: a turn trains the whole model on its client's batches, split
    wherever its cut is, so turn after turn the chain is whole-model SGD in client order at
    any cuts. That holds only if every turn starts from the latest copy of every stage (the
    previous client's for the stages it held, the trunk's for the rest). Float rounding
    differs with the cut and training amplifies it, so the loss decrease from the start is
    compared: measured within 1.5% over 3 rounds; a trunk not handed the finished turn's
    stages falls 40% short."""
    plain = ("strategy=sequential", "strategy.momentum=0", "strategy.num_rounds=3")
    fixed, moving = (
        [r["test_loss"] for r in run_local(small_config(*plain, *cuts), concurrency=1).history]
        for cuts in (("model.cut=2",), ROTATING)
    )
    for a, b in zip(fixed[1:], moving[1:], strict=True):
        assert moving[0] - b == pytest.approx(fixed[0] - a, rel=0.05)
    assert fixed[0] - fixed[-1] > 0.02  # it learned: the comparison is not of noise


@pytest.mark.parametrize("strategy", ["splitfed_v2", "ushaped"])
def test_int8_at_the_cut_trains_on_a_quarter_of_the_bytes_or_less(strategy):
    """Both directions quantised (U-shaped: activations, features and both gradients)."""
    runs = {method: run_local(small_config(f"strategy={strategy}", f"compression={method}"),
                              concurrency=1).history for method in ("none", "int8")}
    plain, int8 = runs["none"], runs["int8"]
    up, down = (plain[-1][k] / int8[-1][k] for k in ("bytes_up", "bytes_down"))
    assert up > 3.5 and down > 3.5
    if strategy == "splitfed_v2":
        # Down, dense gradients: a byte a value. Up, after ReLU: its zeros cost a bit each.
        assert down < 4.0 and up > 4.5
    assert int8[-1]["test_accuracy"] > int8[0]["test_accuracy"] + 0.2
    assert int8[-1]["test_accuracy"] == pytest.approx(plain[-1]["test_accuracy"], abs=0.05)


class RememberedGrid(LocalGrid):
    """The in-process grid, kept for the test to read its nodes' contexts after the run."""

    last: RememberedGrid | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        RememberedGrid.last = self


def test_error_feedback_keeps_each_devices_references_across_rounds():
    """Top-k both ways with error feedback: every device's references absorb every batch of
    every round (no start-over from zero), the bytes are top-k's plus 8 per row and a few
    per frame, and it trains."""
    from clients.app import FEEDBACK_STATE_KEY
    from splitlearn.dataplane.feedback import ReferenceFeedback
    from splitlearn.messages import record_to_state

    cfg = small_config("compression=topk_feedback", "strategy.num_rounds=3")
    history = run_local(cfg, grid_type=RememberedGrid).history
    plain = run_local(small_config("compression=topk", "strategy.num_rounds=3")).history
    contexts = RememberedGrid.last.contexts.values()
    kept = [ReferenceFeedback.from_state(record_to_state(c.state[FEEDBACK_STATE_KEY]),
                                      max_bytes=1 << 30) for c in contexts]
    steps = sum(r["steps"] for r in history[1:])
    assert sum(k.version for k in kept) == steps  # one commit per batch, none lost
    assert all(len(k.references) == 1437 // cfg.num_clients for k in kept)
    examples = sum(r["examples"] for r in history[1:])
    extra = sum(r["bytes_up"] for r in history[1:]) - sum(r["bytes_up"] for r in plain[1:])
    # The ids, and a frame's version and lineage (10 bytes) and the ids' tensor header.
    assert 8 * examples <= extra <= 8 * examples + 32 * steps
    assert history[-1]["test_accuracy"] > history[0]["test_accuracy"] + 0.2


def test_ushaped_error_feedback_keeps_both_references_across_rounds():
    """U-shaped with int8 up and top-k down, with error feedback: every device's activation
    and feature references absorb every batch of every round (one version for both, no
    start-over from zero), a row per example each, and it trains."""
    from clients.app import FEATURE_FEEDBACK_STATE_KEY, FEEDBACK_STATE_KEY
    from splitlearn.dataplane.feedback import ReferenceFeedback
    from splitlearn.messages import record_to_state

    cfg = small_config("strategy=ushaped", "strategy.num_rounds=3", "compression=topk_feedback",
                       "dataplane.compression.uplink=int8")
    history = run_local(cfg, grid_type=RememberedGrid).history
    states = [c.state for c in RememberedGrid.last.contexts.values()]

    def kept(key: str) -> list[ReferenceFeedback]:
        return [ReferenceFeedback.from_state(record_to_state(s[key]), max_bytes=1 << 30)
                for s in states]

    activations, features = kept(FEEDBACK_STATE_KEY), kept(FEATURE_FEEDBACK_STATE_KEY)
    assert [a.version for a in activations] == [f.version for f in features]
    assert sum(a.version for a in activations) == sum(r["steps"] for r in history[1:])
    held = 1437 // cfg.num_clients
    assert all(len(a.references) == len(f.references) == held
               for a, f in zip(activations, features, strict=True))
    assert history[-1]["test_accuracy"] > history[0]["test_accuracy"] + 0.2


@pytest.mark.parametrize(("strategy", "uplink", "downlink"), [
    ("fedavg", "none", "none"), ("splitfed_v2", "none", "none"), ("sequential", "none", "none"),
    ("ushaped", "none", "none"), ("splitfed_v2", "bfloat16", "int8"), ("ushaped", "topk", "topk"),
])
def test_bytes_moved_per_sample_are_the_closed_forms(strategy, uplink, downlink):
    """Measured bytes (data plane and weights, both ways) against splitlearn.communication."""
    from protocols import protocol_named, tail_cut_of
    from splitlearn.calibration import communication_sizes
    from splitlearn.communication import bytes_per_sample
    from splitlearn.config import to_object
    from splitlearn.models.factory import build_model_from_config

    cfg = small_config(f"strategy={strategy}", f"dataplane.compression.uplink={uplink}",
                       f"dataplane.compression.downlink={downlink}")
    rounds = run_local(cfg, concurrency=1).history[1:]
    assert OmegaConf.is_missing(cfg, "run_dir")  # run_local's temporary folder stayed its own
    measured = (sum(r["bytes_up"] + r["bytes_down"] for r in rounds)
                / sum(r["examples"] for r in rounds))
    model = build_model_from_config(to_object(cfg.model), to_object(cfg.dataset))
    sizes = communication_sizes(model, cfg.model.cut,
                                tail_cut=tail_cut_of(to_object(cfg.strategy), model))
    protocol = protocol_named(strategy)
    predicted = bytes_per_sample(protocol.capabilities.bytes_per_sample, sizes,
                                 samples_per_client=1437 / cfg.num_clients,
                                 local_epochs=cfg.strategy.local_epochs, uplink=uplink,
                                 downlink=downlink)
    # Framing is all the closed form leaves out: at most 64 bytes a frame, a request and a
    # reply per exchange (U-shaped: two a batch); FedAvg's weights are exact.
    frames = 2 * protocol.client.exchanges_per_batch
    samples = 1437 / cfg.num_clients
    framing = 64 * frames * math.ceil(samples / cfg.strategy.batch_size) / samples
    assert 0 <= measured - predicted["total"] <= framing + 1e-9 * measured


def test_fedavg_trains_a_batch_norm_network_past_round_one():
    """Averaging keeps integer buffers integers: num_batches_tracked came back float64, and
    every client's round-2 reply was refused for returning it as int64."""
    history = run_local(small_config("strategy=fedavg", "model=resnet", "dataset.image_size=16",
                                     "strategy.num_rounds=3"), concurrency=1).history
    assert all(r["clients"] == 3 and r["failed_clients"] == 0 for r in history[1:])
    assert history[-1]["test_accuracy"] > history[0]["test_accuracy"] + 0.2


def test_nopeek_decorrelates_what_devices_send_from_their_inputs():
    """The same run with NoPeek's penalty: the trained bottom's outputs on held-out images
    carry less of the images (bias-corrected dCor), and the model still learns."""
    from splitlearn.attacks.dcor import bias_corrected_distance_correlation
    from splitlearn.stages import split

    images = held_out_dataset(DatasetConfig(), seed=0).tensors[0][:300]
    scores, accuracy = {}, {}
    for weight in (0.0, 10.0):
        result = run_local(small_config(f"privacy.nopeek_weight={weight}",
                                        "strategy.num_rounds=3"), concurrency=1)
        with torch.no_grad():
            sent = split(result.model, 1)[0](images)
        scores[weight] = bias_corrected_distance_correlation(images, sent)
        accuracy[weight] = result.history[-1]["test_accuracy"] - result.history[0]["test_accuracy"]
    assert scores[10.0] < scores[0.0] - 0.03
    assert accuracy[10.0] > 0.15
