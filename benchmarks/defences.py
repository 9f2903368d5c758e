"""What the trunk's defences cost honest runs: ``python -m benchmarks defences``.

The default job and ``+scenario=heterogeneous``, each with the defences as shipped (the
trunk's guard: bounds on rows, clipped steps, the loss check, quarantine; example counts
capped at ``aggregation.max_examples_ratio``; updates bounded at
``aggregation.max_update_ratio``) and without them (:data:`OFF`). Runs
alternate, on then off, ``--repeats`` times per job, so that a host that slows down
during the benchmark weighs on both settings alike. No device lies here: whatever the
guard refuses or clips in an "on" run is a cost to honest devices.

Per run: the final test accuracy, the steady seconds per round (median of rounds 2+)
and the guard's counts summed over the run. Written to the output folder:
``defences.csv`` (a row per run), ``defences.json`` (the medians per job and setting)
and ``defences.png``. The last line printed is that JSON.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.rounds import run_job, steady_median
from experiments.poison import DEFENCES_OFF

#: The jobs measured: their overrides (beside the user's own).
JOBS = {"default": [], "heterogeneous": ["+scenario=heterogeneous"]}

#: The defences switched off (the attack suite's "off").
OFF = list(DEFENCES_OFF)

#: The guard's counts per round (``server.guard.TrunkGuard.take_books``) and the devices
#: whose update was shortened (``aggregation.max_update_ratio``).
BOOKS = ("guard_refused", "guard_loss_refused", "guard_clipped", "guard_quarantined",
         "updates_shortened")


def measure(overrides: Sequence[str]) -> dict[str, float]:
    """Run the job once without tracking; return its accuracy, round time and guard counts."""
    history, _, seconds = run_job([*overrides, "logger=none", "checkpoint=false"])
    row = {"accuracy": history[-1]["test_accuracy"], "round_s": steady_median(history),
           "command_s": seconds}
    return row | {key: sum(r.get(key, 0) for r in history) for key in BOOKS}


def bench_defences(overrides: Sequence[str], *, repeats: int = 3,
                   out_dir: Path | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """Measure every job of :data:`JOBS` with the defences on and off, alternately."""
    out_dir = out_dir or Path("outputs/bench") / time.strftime("defences-%Y-%m-%d-%H-%M-%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for job, extra in JOBS.items():
        for repeat in range(1, repeats + 1):
            for setting, switch in (("on", []), ("off", OFF)):
                row = {"job": job, "defences": setting, "repeat": repeat,
                       **measure([*extra, *overrides, *switch])}
                rows.append(row)
                print(f"{job:>13} defences {setting:<3} run {repeat}/{repeats}: accuracy "
                      f"{row['accuracy']:.4f}, {row['round_s']:.3f} s per round, guard "
                      + ", ".join(f"{k.removeprefix('guard_')} {row[k]:.0f}" for k in BOOKS),
                      flush=True)
    with open(out_dir / "defences.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = summarise(rows)
    (out_dir / "defences.json").write_text(json.dumps(summary, indent=2))
    plot_defences(rows, out_dir / "defences.png")
    print(f"results in {out_dir}")
    print(json.dumps(summary))
    return summary


def summarise(rows: Sequence[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """Medians per job and setting, and what the defences cost (on against off)."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for job in dict.fromkeys(r["job"] for r in rows):
        medians = {setting: {key: statistics.median(r[key] for r in rows
                                                    if r["job"] == job and r["defences"] == setting)
                             for key in ("accuracy", "round_s", *BOOKS)}
                   for setting in ("on", "off")}
        medians["cost"] = {
            "accuracy_points": 100 * (medians["off"]["accuracy"] - medians["on"]["accuracy"]),
            "round_time_ratio": medians["on"]["round_s"] / medians["off"]["round_s"]}
        summary[job] = medians
    return summary


def plot_defences(rows: Sequence[dict], path: Path) -> None:
    """Accuracy and seconds per round of every run, on against off, per job."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = list(dict.fromkeys(r["job"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), constrained_layout=True)
    for ax, key, label in ((axes[0], "accuracy", "final test accuracy"),
                           (axes[1], "round_s", "seconds per steady round")):
        for offset, setting in ((-0.15, "on"), (0.15, "off")):
            xs = [jobs.index(r["job"]) + offset for r in rows if r["defences"] == setting]
            ys = [r[key] for r in rows if r["defences"] == setting]
            ax.scatter(xs, ys, label=f"defences {setting}", alpha=0.8)
        ax.set_xticks(range(len(jobs)), jobs)
        ax.set_ylabel(label)
    axes[0].legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)
