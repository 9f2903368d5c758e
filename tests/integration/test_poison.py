"""``python -m experiments.attack poison``: its table, and the guard against its first attack.

A small run of the CLI (5 devices, 4 rounds, one liar sending every activation at
``dataplane.max_abs_value``): with the defences on the trunk learns as it does without an
attacker; with them off the same attack leaves it at chance and refuses honest batches
``STEP_NOT_FINITE``. Judged against the suite's own no-attack runs, not against numbers
copied from a run. The same liar against trunk workers (``dataplane.trunk_workers=2``):
their guards are seeded as the ServerApp's own, and their refusals reach the round.
"""

from __future__ import annotations

import csv
import json

from experiments.attack import main
from experiments.local import run_local
from experiments.poison import ExtremeActivations, Refusals, lying_fleet
from tests.conftest import small_config
from tests.integration.test_simulation import read_clients

SMALL = ("num_clients=5", "strategy.num_rounds=4")


def test_the_poison_table_and_the_guard_against_extreme_activations(tmp_path, capsys):
    main(["poison", *SMALL, "--attacks", "extreme_activations", "--attackers", "1",
          "--concurrency", "1", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "| extreme_activations | splitfed_v2 | 1 | on |" in printed
    rows = {(r["attack"], r["defences"]): r
            for r in json.loads((tmp_path / "poison.json").read_text())}
    assert set(rows) == {("none", "on"), ("none", "off"), ("extreme_activations", "on"),
                         ("extreme_activations", "off")}
    with open(tmp_path / "poison.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    assert (tmp_path / "poison.md").read_text().startswith("| attack |")
    assert (tmp_path / "poison.png").stat().st_size > 0

    reference, on = rows["none", "on"], rows["extreme_activations", "on"]
    assert reference["accuracy"] > 0.5  # it learned: the comparison means something
    assert on["accuracy"] > reference["accuracy"] - 0.15
    assert on["honest_refused"] == {}
    assert on["quarantined"] == 4  # the liar, every round
    assert on["attacker_refused"] == {"OUT_OF_RANGE": 8, "QUARANTINED": 4}

    off, unguarded = rows["extreme_activations", "off"], rows["none", "off"]
    assert unguarded["accuracy"] > 0.5
    assert off["accuracy"] < 0.25 < unguarded["accuracy"]  # at chance: the trunk is wrecked
    assert off["honest_refused"].get("STEP_NOT_FINITE", 0) > 0


def test_trunk_workers_refuse_a_liars_first_frame_and_the_round_counts_it(tmp_path):
    """The liar is partition 0: node 1, dealt to the first worker and served first each
    round (one device at a time), so its first frame is the round's first anywhere. The
    worker's guard refuses it at once (seeded from the server's rows, as the trunk in
    process is), then quarantines the liar; the round's metrics count the worker's books,
    and the liar's clients.csv row says why it was refused."""
    refusals = Refusals()
    cfg = small_config("dataplane.trunk_workers=2", run_dir=str(tmp_path))
    result = run_local(cfg, client_app=lying_fleet(ExtremeActivations(), [0], refusals))

    # Refused from its first frame: none of its rows trained a trunk, whose loss stays sane.
    assert refusals.of("attacker") == {"OUT_OF_RANGE": 4, "QUARANTINED": 2}
    assert refusals.of("honest") == {}
    rounds = result.history[1:]
    assert all(r["test_loss"] < 3 for r in rounds)
    assert [(r["guard_refused"], r["guard_quarantined"]) for r in rounds] == [(2, 1), (2, 1)]
    liar = [(r["status"], r["reason"]) for r in read_clients(tmp_path) if r["client"] == "0"]
    assert liar == [("refused", "QUARANTINED: client 1 is quarantined for round "
                     f"{n} after 2 refused frames") for n in (1, 2)]
