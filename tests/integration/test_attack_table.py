"""``python -m experiments.attack table --quick``: the privacy-utility table in seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_table_runs_every_row_and_noise_lowers_what_leaks(tmp_path):
    out = tmp_path / "table.md"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.attack", "table", "--quick", "--out", str(out)],
        cwd=ROOT, env=os.environ | {"FLWR_TELEMETRY_ENABLED": "0"}, capture_output=True,
        text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    header, _, *rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    column = {name: header.index(name) for name in ("privacy", "sigma", "inversion SSIM",
                                                     "dCor² (bias-corrected)")}
    assert [r[column["privacy"]] for r in rows] == [
        "none", *["activation_gaussian"] * 4, "dpsgd_client", "none + NoPeek 10",
        "none + label RR eps 1", "none + SecAgg+ + DP-FedAvg sigma 1 C 0.5"]
    noised = rows[:5]  # no noise, then sigma 0.01 .. 0.3
    corrected = [float(r[column["dCor² (bias-corrected)"]]) for r in noised]
    ssim = [float(r[column["inversion SSIM"]]) for r in noised]
    # More noise, less dependence between images and rows, and worse reconstructions.
    assert corrected == sorted(corrected, reverse=True) and corrected[0] > 0.9
    assert corrected[-1] < 0.15
    assert ssim[-1] < ssim[0] - 0.2
    # Averaging linked releases takes noise off (sqrt 10): better reconstructions at sigma 0.3;
    # the white-box search through the device's layers inverts the unnoised rows.
    linked = float(noised[-1][header.index("SSIM, 10 linked releases")])
    assert linked > ssim[-1] + 0.1
    assert float(rows[0][header.index("white-box SSIM")]) > 0.8
    # NoPeek trains the bottom to decorrelate its outputs from its inputs.
    nopeek = float(rows[-3][column["dCor² (bias-corrected)"]])
    assert nopeek < corrected[0]
    # Randomised labels: the trunk's gradients point at the released labels, not the true.
    auc = header.index("label AUC (direction)")
    assert float(rows[-2][auc]) < float(rows[0][auc]) - 0.1
    # Only DP-FedAvg bounds what the weights say: a finite client-level epsilon on that row.
    weights = header.index("weights epsilon (client-level)")
    assert [r[weights] for r in rows[:-1]] == ["inf"] * (len(rows) - 1)
    assert 0 < float(rows[-1][weights]) < 100
