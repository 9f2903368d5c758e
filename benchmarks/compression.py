"""Compression at the cut: bytes saved against accuracy lost, per method and network.

``python -m benchmarks compression [--seeds N] [overrides ...]``

For each network (the default job's SmallCNN on digits at cut 1, and the
ResNet-style network on digits resized to 16x16 at cut 1) and seed, SplitFed v2
is trained once per option of :data:`OPTIONS` (each method of
:data:`splitlearn.config.COMPRESSION_METHODS`, and top-k with per-example error
feedback), both directions compressed (``compression=OPTION``), through the shipped
strategy, ClientApp and trunk in this process (:func:`experiments.local.run_local`,
one client at a time, so that two runs differ only by their encoding). Per run:
bytes per training sample (data plane and weights, up and down, every round) and the final
test accuracy. Writes ``compression.csv``, ``compression.json`` and
``compression.png``; the last line printed is JSON with, per network, the
largest reduction among the methods within ``max_drop`` points of the
uncompressed accuracy (mean over seeds).
"""

from __future__ import annotations

import csv
import json
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from protocols import compose_config
from splitlearn.config import COMPRESSION_METHODS

#: The ``compression=`` options compared: every method, and top-k with error feedback.
OPTIONS = (*COMPRESSION_METHODS, "topk_feedback")
#: The networks compared: (label, overrides).
NETWORKS = (
    ("digits SmallCNN", ("model=cnn",)),
    ("digits ResNet 16x16", ("model=resnet", "dataset.image_size=16", "strategy.num_rounds=10")),
)


@dataclass(frozen=True)
class CompressionRun:
    """One training run's bytes and accuracy."""

    network: str
    method: str
    seed: int
    bytes_per_sample: float  # data plane and weights, up + down, per training sample
    up_per_sample: float
    down_per_sample: float
    final_accuracy: float


def run_one(network: str, overrides: Sequence[str], method: str, seed: int) -> CompressionRun:
    """Train one configuration; return its bytes per sample and final accuracy."""
    from experiments.local import run_local

    cfg = compose_config([*overrides, f"compression={method}", f"seed={seed}", "logger=none"])
    torch.set_num_threads(cfg.engine.torch_threads)
    logging.getLogger("flwr").setLevel(logging.WARNING)  # a line per run, not per round
    history = [r for r in run_local(cfg, concurrency=1).history if r["round"] >= 1]
    samples = sum(r["examples"] for r in history)
    up = sum(r["bytes_up"] for r in history) / samples
    down = sum(r["bytes_down"] for r in history) / samples
    return CompressionRun(network, method, seed, up + down, up, down,
                          history[-1]["test_accuracy"])


def summarise(runs: Sequence[CompressionRun], *, max_drop: float) -> dict:
    """Per network and method: mean bytes per sample, reduction and accuracy drop vs none."""
    summary: dict = {}
    for network in dict.fromkeys(r.network for r in runs):
        mine = [r for r in runs if r.network == network]
        rows = {}
        for method in dict.fromkeys(r.method for r in mine):
            of = [r for r in mine if r.method == method]
            rows[method] = {"bytes_per_sample": statistics.fmean(r.bytes_per_sample for r in of),
                            "accuracy": statistics.fmean(r.final_accuracy for r in of),
                            "accuracies": [r.final_accuracy for r in of]}
        base = rows["none"]
        for row in rows.values():
            row["reduction"] = base["bytes_per_sample"] / row["bytes_per_sample"]
            row["drop_points"] = 100 * (base["accuracy"] - row["accuracy"])
        within = {m: r for m, r in rows.items() if r["drop_points"] <= max_drop}
        best = max(within, key=lambda m: within[m]["reduction"])
        summary[network] = {"methods": rows, "best_within_drop": best,
                            "best_reduction": within[best]["reduction"],
                            "best_drop_points": within[best]["drop_points"]}
    return summary


def plot(summary: dict, path: Path) -> None:
    """Bytes per sample against accuracy drop, one panel per network."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, len(summary), figsize=(5.5 * len(summary), 4), squeeze=False)
    for ax, (network, row) in zip(axes[0], summary.items(), strict=True):
        for method, m in row["methods"].items():
            ax.scatter(m["bytes_per_sample"] / 1024, m["drop_points"], s=40)
            ax.annotate(f"{method} ({m['reduction']:.1f}x)",
                        (m["bytes_per_sample"] / 1024, m["drop_points"]), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
        ax.axhline(0.5, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        # Plain numbers at 1, 2, 5, 10, ...: the default minor labels (3x10^0 ...) overlap.
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("KiB moved per training sample (data plane and weights, both ways)")
        ax.set_ylabel("accuracy lost vs uncompressed (points)")
        ax.set_title(network)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_compression(overrides: Sequence[str], *, seeds: int = 3, max_drop: float = 0.5,
                      out_dir: Path | None = None, methods: Sequence[str] = OPTIONS) -> dict:
    """Run every option (``methods``) on every network and seed; print and return the summary.

    ``methods`` must include ``none``, the baseline of every reduction and drop.
    """
    if "none" not in methods:
        raise ValueError(f"--methods {' '.join(methods)}: include none, the baseline")
    out_dir = out_dir or Path("outputs/bench") / time.strftime("compression-%Y-%m-%d-%H-%M-%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{seeds} seeds; results in {out_dir}", flush=True)
    runs: list[CompressionRun] = []
    for network, extra in NETWORKS:
        for seed in range(seeds):
            for method in methods:
                started = time.perf_counter()
                run = run_one(network, [*extra, *overrides], method, seed)
                runs.append(run)
                print(f"{network} seed {seed} {method:>13}: {run.bytes_per_sample / 1024:8.2f} KiB "
                      f"per sample, accuracy {run.final_accuracy:.4f} "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
                write_rows(runs, out_dir / "compression.csv")
    summary = summarise(runs, max_drop=max_drop)
    (out_dir / "compression.json").write_text(json.dumps(summary, indent=2))
    plot(summary, out_dir / "compression.png")
    for network, row in summary.items():
        for method, m in row["methods"].items():
            print(f"{network:>20} {method:>13}: {m['bytes_per_sample'] / 1024:8.2f} KiB/sample "
                  f"({m['reduction']:5.2f}x fewer), accuracy {m['accuracy']:.4f} "
                  f"({m['drop_points']:+.2f} points lost)")
    last = {network: {"method": row["best_within_drop"], "reduction": row["best_reduction"],
                      "drop_points": row["best_drop_points"]} for network, row in summary.items()}
    last["worst_best_reduction"] = min(row["best_reduction"] for row in summary.values())
    print(json.dumps(last))
    return summary


def write_rows(runs: Sequence[CompressionRun], path: Path) -> None:
    """One CSV row per run."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(runs[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in runs)
