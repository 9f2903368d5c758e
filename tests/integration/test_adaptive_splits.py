"""Per-client cuts end to end, through the shipped apps in process (the same strategy,
ClientApp, trunk and run folder as in an engine, without its start-up): the merge (v1 ==
FedAvg, in node ids drawn as an engine draws them), moves and planners."""

from __future__ import annotations

import json
import random

import pytest
import torch
from flwr.app import Context

from experiments.local import LocalGrid, run_local
from protocols import compose_config
from tests.integration.test_simulation import read_clients, run_in_process

SMALL = ("strategy.num_rounds=2", "num_clients=3", "logger=none")
#: Client k (by node id) takes cuts[(k + round) % 3]: cuts differ in a round and move.
ROTATING = ("planner=rotate", "planner.cuts=[1,2,3]")


def rounds_of(run_dir):
    return json.loads((run_dir / "metrics.json").read_text())


class EngineLikeGrid(LocalGrid):
    """Node ids drawn at random, as Flower's engines draw them, in no order of partitions.

    Replies must then be merged by partition, not by node id: a float sum depends on
    its order (see :func:`strategies.reporting.reply_order`).
    """

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        ids = random.Random(7).sample(range(1, 2**63), len(self.contexts))
        assert ids != sorted(ids)  # partitions 0, 1, 2 are not in node order
        self.contexts = {new: Context(run_id=c.run_id, node_id=new, node_config=c.node_config,
                                      state=c.state, run_config=c.run_config)
                         for new, c in zip(ids, self.contexts.values(), strict=True)}


def test_splitfed_v1_with_different_and_moving_cuts_is_fedavg_of_the_whole_model(tmp_path):
    """A trunk copy per client: each client trains every stage once, split between its
    two copies, and every stage is averaged by samples, so the cuts cannot matter."""
    # Bit for bit needs the trunk to compute in the layout the whole model trains in on a
    # device: channels-last (the SmallCNN's default) rounds floats otherwise (1e-6 here).
    three = ("strategy.num_rounds=3", *SMALL[1:], "dataplane.channels_last=false")
    cfg = compose_config(["strategy=splitfed_v1", *ROTATING, *three])
    cfg.run_dir = str(v1_dir := tmp_path / "v1")
    # Two clients at a time, in the engine's node ids, as the Simulation Engine runs them.
    run_local(cfg, concurrency=2, grid_type=EngineLikeGrid)
    fedavg_dir = run_in_process(tmp_path / "fedavg", "strategy=fedavg", *three)
    fedavg = {"rounds": rounds_of(fedavg_dir), "model": torch.load(fedavg_dir / "model.pt")}
    assert [r["test_loss"] for r in rounds_of(v1_dir)] == [
        r["test_loss"] for r in fedavg["rounds"]]
    # Bit for bit: both average a round by partition, and each stage adds a client's
    # copy, whichever side holds it, where FedAvg adds that client's model. Summed in
    # another order (client copies first, or by the engine's random node ids) the same
    # maths drifted to 1.7e-3 after 3 rounds; merges gone wrong, measured: copies
    # weighted equally instead of by samples 2.3e-3, trunk copies left out 5.5e-2.
    v1_model = torch.load(v1_dir / "model.pt")
    assert max((v1_model[k] - t).abs().max().item() for k, t in fedavg["model"].items()) == 0.0
    cuts = cuts_by_round(read_clients(v1_dir))
    assert all(set(cuts[r].values()) == {1, 2, 3} for r in ("1", "2", "3"))
    assert all(cuts["1"][c] != cuts["2"][c] != cuts["3"][c] for c in cuts["1"])  # all moved


def cuts_by_round(rows) -> dict[str, dict[str, int]]:
    cuts: dict[str, dict[str, int]] = {}
    for r in rows:
        cuts.setdefault(r["round"], {})[r["client"]] = int(float(r["cut"]))
    return cuts


def test_splitfed_v2_with_moving_cuts_trains_and_charges_the_weights_it_moves(tmp_path):
    run_dir = run_in_process(tmp_path, "strategy=splitfed_v2", *ROTATING, *SMALL)
    rounds = rounds_of(run_dir)
    assert rounds[2]["test_accuracy"] > rounds[0]["test_accuracy"] + 0.1
    rows = [r for r in read_clients(run_dir) if r["status"] == "ok"]
    assert len(rows) == 6
    by_cut = {}
    for r in rows:
        down = int(float(r["weights_bytes_down"]))
        assert down == int(float(r["weights_bytes_up"])) > 0
        by_cut.setdefault(int(float(r["cut"])), set()).add(down)
    # A deeper cut receives (and returns) more stages: moving a cut moves weights.
    sizes = [next(iter(by_cut[c])) for c in sorted(by_cut)]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)


def test_smartsplit_selects_half_the_fleet_and_brings_back_the_rest(tmp_path):
    """m = 2 of 4 alike clients train per round, and the two left out in round 1 are first
    in line in round 2 (never tried), so no client is starved."""
    run_dir = run_in_process(tmp_path, "strategy=splitfed_v2", "planner=smartsplit",
                             "planner.select_fraction=0.5", "strategy.num_rounds=2",
                             "num_clients=4", "logger=none")
    trained = {}
    for r in read_clients(run_dir):
        if r["status"] == "ok":
            trained.setdefault(r["round"], set()).add(r["client"])
    assert [len(trained[r]) for r in ("1", "2")] == [2, 2]
    assert trained["1"].isdisjoint(trained["2"])
    rounds = rounds_of(run_dir)
    assert rounds[2]["test_loss"] < rounds[1]["test_loss"] < rounds[0]["test_loss"]
    # Each planned round records its prediction beside the clock's charge. Both play the
    # round out at the trunk: at least the slowest device's own time, at most that plus
    # every trunk step after it (the planner's objective, in its parts).
    for row in rounds[1:]:
        assert row["planned_makespan_s"] == pytest.approx(
            row["planned_slowest_client_s"] + row["planned_trunk_s"])
        assert row["planned_slowest_client_s"] <= row["planned_round_s"] * (1 + 1e-9)
        assert row["planned_round_s"] <= row["planned_makespan_s"] * (1 + 1e-9)
        assert row["slowest_client_s"] <= row["virtual_round_s"] * (1 + 1e-9)
        assert row["virtual_round_s"] <= (row["slowest_client_s"] + row["trunk_s"]) * (1 + 1e-9)
        assert row["planned_finished_round_s"] == row["planned_round_s"]  # none failed
        assert row["plan_error"] == pytest.approx(
            row["planned_round_s"] / row["virtual_round_s"] - 1)


def test_ushaped_with_moving_cuts_keeps_the_tail_and_labels_on_the_devices(tmp_path):
    """U-shaped per-client cuts: every client gets its head and the tail,
    a deeper cut more weights; the round trains; the trunk never sees labels (it refuses
    them) and the devices report the loss."""
    run_dir = run_in_process(tmp_path, "strategy=ushaped", *ROTATING, *SMALL)
    rounds = rounds_of(run_dir)
    assert rounds[2]["test_accuracy"] > rounds[0]["test_accuracy"] + 0.1
    rows = [r for r in read_clients(run_dir) if r["status"] == "ok"]
    assert len(rows) == 6
    cuts = cuts_by_round(rows)
    assert all(set(cuts[r].values()) == {1, 2, 3} for r in ("1", "2"))
    by_cut = {int(float(r["cut"])): int(float(r["weights_bytes_down"])) for r in rows}
    assert by_cut[1] < by_cut[2] < by_cut[3]
    assert all(float(r["train_loss"]) > 0 for r in rows)
