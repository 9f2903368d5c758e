"""``python -m experiments.attack poison``: its table, and the guard against its first attack.

A small run of the CLI (4 devices, 3 rounds, one liar sending every activation at
``dataplane.max_abs_value``): with the defences on the trunk learns as it does without an
attacker; with them off the same attack leaves it at chance and refuses honest batches
``STEP_NOT_FINITE``. Judged against the suite's own no-attack runs, not against numbers
copied from a run.
"""

from __future__ import annotations

import csv
import json

from experiments.attack import main

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
