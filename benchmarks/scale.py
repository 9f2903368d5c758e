"""Time per sample and server memory as the federation grows: ``bench scale``.

``+scenario=large_scale`` (SplitFed v2, the SmallCNN, a mixed fleet,
``dataset=synthetic``: every client holds 64 examples of its own whatever the
federation's size) with each number of registered clients in ``registered``, the
same 10 clients sampled per round, 5 rounds. Each run is ``python -m
experiments.run`` in a subprocess whose memory is sampled from /proc every 0.2 s:
the peak of its own process (the ServerApp, the trunk, the Simulation Engine's
node registry) and of its whole process tree (Ray's workers included). Time per
training sample is a steady round's wall time (rounds 2+: sending, training,
aggregating, evaluating) over the samples it trained, the median round. Writes
``scale.json`` and ``scale.png``; the last line is JSON with the spread of time per
sample (largest over smallest) and the memory ratios from the smallest to the
largest federation.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

PER_ROUND = 10
ROUNDS = 5
#: The issue's target: time per sample within this fraction of the mean, across sizes.
TOLERANCE = 0.15


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def descendants(root: int) -> set[int]:
    """``root`` and every process below it."""
    parents: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
                parents[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return tree


def run_measured(overrides: Sequence[str]) -> dict:
    """Run ``experiments.run`` in a subprocess; return its rounds, peaks and wall time."""
    with tempfile.TemporaryDirectory(prefix="bench-") as run_dir:
        cmd = [sys.executable, "-m", "experiments.run", f"hydra.run.dir={run_dir}", *overrides]
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        peak_main = peak_tree = 0
        while proc.poll() is None:
            peak_main = max(peak_main, rss_bytes(proc.pid))
            peak_tree = max(peak_tree, sum(rss_bytes(p) for p in descendants(proc.pid)))
            time.sleep(0.2)
        stderr = proc.stderr.read() if proc.stderr else ""
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{stderr[-3000:]}")
        rounds = json.loads((Path(run_dir) / "metrics.json").read_text())
    return {"rounds": rounds, "peak_main_bytes": peak_main, "peak_tree_bytes": peak_tree,
            "wall_s": time.perf_counter() - started}


def seconds_per_sample(rounds: Sequence[dict]) -> float:
    """Median over rounds 2+ of the round's wall time over the samples it trained."""
    by_round = {int(r["round"]): r for r in rounds}
    ratios = [(by_round[n]["wall_s"] - by_round[n - 1]["wall_s"]) / by_round[n]["examples"]
              for n in sorted(by_round) if n >= 2 and by_round[n].get("examples")]
    if not ratios:
        raise ValueError("need at least 2 training rounds to measure steady state")
    return statistics.median(ratios)


def scale_row(registered: int, overrides: Sequence[str]) -> dict:
    """Run the scenario with ``registered`` clients, 10 per round; return its figures."""
    run = ["+scenario=large_scale", f"num_clients={registered}", "logger=none",
           f"strategy.fraction_train={PER_ROUND / registered}",
           f"strategy.min_train_nodes={PER_ROUND}", f"strategy.num_rounds={ROUNDS}",
           *overrides]
    measured = run_measured(run)
    rounds = measured.pop("rounds")
    return measured | {"registered": registered, "seconds_per_sample": seconds_per_sample(rounds),
                       "test_accuracy": rounds[-1]["test_accuracy"]}


def bench_scale(overrides: Sequence[str], *, registered: Sequence[int] = (10, 100, 1000, 10000),
                out_dir: Path | None = None) -> dict:
    """Run every size; print a table and the summary JSON; return the summary."""
    out_dir = out_dir or Path("outputs/bench") / time.strftime("scale-%Y-%m-%d-%H-%M-%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in registered:
        row = scale_row(n, overrides)
        rows.append(row)
        print(f"{n:>6} registered: {1e3 * row['seconds_per_sample']:6.2f} ms/sample, peak RSS "
              f"ServerApp {row['peak_main_bytes'] / 2**20:7.1f} MiB, tree "
              f"{row['peak_tree_bytes'] / 2**20:7.1f} MiB, {row['wall_s']:.1f} s, "
              f"test accuracy {row['test_accuracy']:.3f}", flush=True)
    per_sample = [r["seconds_per_sample"] for r in rows]
    mean = statistics.mean(per_sample)
    summary = {
        "per_round": PER_ROUND, "rounds": ROUNDS, "rows": rows,
        "time_per_sample_spread": max(per_sample) / min(per_sample),
        "time_per_sample_worst_deviation": max(abs(t - mean) / mean for t in per_sample),
        "server_memory_ratio": rows[-1]["peak_main_bytes"] / rows[0]["peak_main_bytes"],
        "tree_memory_ratio": rows[-1]["peak_tree_bytes"] / rows[0]["peak_tree_bytes"],
    }
    (out_dir / "scale.json").write_text(json.dumps(summary, indent=2))
    plot_scale(rows, out_dir / "scale.png")
    print(f"results in {out_dir}")
    print(json.dumps({k: round(v, 3) for k, v in summary.items() if isinstance(v, float)}))
    return summary


def plot_scale(rows: Sequence[dict], path: Path) -> None:
    """Two panels against registered clients (log axis): time per sample, and peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["registered"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    per_sample = [1e3 * r["seconds_per_sample"] for r in rows]
    mean = statistics.mean(per_sample)
    left.plot(sizes, per_sample, "o-")
    left.axhspan(mean * (1 - TOLERANCE), mean * (1 + TOLERANCE), color="gray", alpha=0.2,
                 label=f"mean ± {TOLERANCE:.0%}")
    left.set_ylabel("ms per training sample")
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    right.plot(sizes, [r["peak_main_bytes"] / 2**20 for r in rows], "o-", label="ServerApp")
    right.plot(sizes, [r["peak_tree_bytes"] / 2**20 for r in rows], "s-",
               label="process tree (Ray included)")
    right.set_ylabel("peak RSS (MiB)")
    right.set_ylim(bottom=0)
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel(f"registered clients ({PER_ROUND} per round)")
    fig.suptitle("SplitFed v2 as the federation grows")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
