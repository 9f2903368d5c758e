"""The trunk suite times both layouts of real trunk steps and writes what it measured."""

from __future__ import annotations

import csv
import json

from benchmarks.trunk import bench_trunk


def test_the_suite_times_image_activations_and_lists_token_ones(tmp_path, capsys):
    rows = bench_trunk([], steps=2, models=["cnn", "vit"], out_dir=tmp_path)
    # The ViT's activations at its cut are tokens: no layout to choose, nothing timed.
    assert [r.model for r in rows] == ["cnn"]
    (row,) = rows
    assert row.cut == 1 and row.batch == 32 and row.model_prefers_channels_last
    assert row.standard_ms > 0 and row.channels_last_ms > 0
    printed = capsys.readouterr().out.splitlines()
    assert any(line.startswith("vit cut") and "not images" in line for line in printed)
    assert json.loads(printed[-1]) == {"channels_last_speedup": {"cnn": round(row.speedup, 3)}}
    with (tmp_path / "trunk.csv").open() as handle:
        (saved,) = csv.DictReader(handle)
    assert float(saved["standard_ms"]) == row.standard_ms
    assert json.loads((tmp_path / "trunk.json").read_text())[0]["model"] == "cnn"
    assert (tmp_path / "trunk.png").stat().st_size > 0
