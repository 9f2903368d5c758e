"""``python -m experiments.compare``: one row per run folder, from its own files."""

from __future__ import annotations

import json

from experiments.compare import main, summarise_run


def write_run(folder, name: str, accuracies: list[float], clock: list[float]) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"strategy": {"name": name}}))
    rounds = [{"round": 0, "test_accuracy": 0.1, "virtual_time_s": 0.0}] + [
        {"round": i, "test_accuracy": a, "virtual_time_s": t, "examples": 100.0,
         "bytes_up": 1024.0, "compute_s": 0.5, "wall_s": 2.0 * i}
        for i, (a, t) in enumerate(zip(accuracies, clock, strict=True), start=1)]
    (folder / "metrics.json").write_text(json.dumps(rounds))


def test_the_target_is_reached_at_the_first_round_at_it_and_its_clock_is_that_rounds(tmp_path):
    write_run(tmp_path / "0", "splitfed_v2", [0.5, 0.81, 0.79, 0.9], [10.0, 25.0, 40.0, 55.0])
    row = summarise_run(tmp_path / "0", target=0.8)
    assert (row["rounds_to_target"], row["virtual_s_to_target"]) == (2, 25.0)
    assert (row["final_accuracy"], row["best_accuracy"], row["virtual_time_s"]) == (
        0.9, 0.9, 55.0)
    assert row["bytes_up_per_sample"] == 1024.0 / 100.0


def test_a_run_that_never_reaches_it_says_so_in_the_table(tmp_path, capsys):
    write_run(tmp_path / "0", "fedavg", [0.3, 0.5], [5.0, 9.0])
    write_run(tmp_path / "1", "ushaped", [0.6, 0.85], [7.0, 12.0])
    main([str(tmp_path), "--target", "0.8"])
    table = (tmp_path / "comparison.md").read_text()
    assert "virtual s to 80%" in table and table == capsys.readouterr().out
    assert "| fedavg | 50.00% | 50.00% | not reached | not reached |" in table
    assert "| ushaped | 85.00% | 85.00% | 2 | 12.0 |" in table
