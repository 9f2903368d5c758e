r"""Summarise run folders into one comparison table: ``python -m experiments.compare DIR``.

``DIR`` is a Hydra multirun folder (or any folder holding run folders, found by
their ``metrics.json``). One row per run: protocol, final and best test
accuracy, rounds and virtual device seconds to reach the target accuracy, client
bytes sent per training sample, client compute seconds per training sample, virtual device time and
wall time. Writes ``comparison.md`` and ``comparison.csv`` into ``DIR`` and
prints the markdown table.

The protocol comparison in ``docs/explanation/protocols.md`` is made with::

    python -m experiments.run -m +scenario=heterogeneous logger=none \\
        strategy=fedavg,sequential,splitfed_v1,splitfed_v2,ushaped,local_loss,sglr \\
        hydra.sweep.dir=multirun/full
    python -m experiments.compare multirun/full
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = (
    ("strategy", "protocol"),
    ("final_accuracy", "final acc"),
    ("best_accuracy", "best acc"),
    ("rounds_to_target", "rounds to {target:.0%}"),
    ("virtual_s_to_target", "virtual s to {target:.0%}"),
    ("bytes_up_per_sample", "client bytes sent / sample"),
    ("compute_s_per_sample", "client compute s / sample"),
    ("virtual_time_s", "virtual time (s)"),
    ("wall_s", "wall time (s)"),
)


def summarise_run(run_dir: Path, *, target: float) -> dict[str, Any]:
    """One table row from a run folder's config.json and metrics.json."""
    config = json.loads((run_dir / "config.json").read_text())
    rounds = [r for r in json.loads((run_dir / "metrics.json").read_text()) if r["round"] > 0]
    examples = sum(r.get("examples", 0.0) for r in rounds) or float("nan")
    accuracies = [r["test_accuracy"] for r in rounds]
    reached = [r for r in rounds if r["test_accuracy"] >= target]
    name = config["strategy"]["name"]
    if config["strategy"].get("batch_concurrent"):
        name += " (batched)"
    if config["strategy"].get("bulk"):
        name += " (bulk)"
    return {
        "strategy": name,
        "final_accuracy": accuracies[-1] if accuracies else float("nan"),
        "best_accuracy": max(accuracies, default=float("nan")),
        "rounds_to_target": reached[0]["round"] if reached else None,
        # The devices' time the run took to get there (the virtual clock at that round's end).
        "virtual_s_to_target": reached[0].get("virtual_time_s") if reached else None,
        "bytes_up_per_sample": sum(r.get("bytes_up", 0.0) for r in rounds) / examples,
        "compute_s_per_sample": sum(r.get("compute_s", 0.0) for r in rounds) / examples,
        "virtual_time_s": rounds[-1].get("virtual_time_s", float("nan")) if rounds else 0.0,
        "wall_s": rounds[-1].get("wall_s", float("nan")) if rounds else 0.0,
        "run_dir": str(run_dir),
    }


def find_runs(root: Path) -> list[Path]:
    """Run folders under ``root`` (those with both config.json and metrics.json)."""
    found = root.rglob("metrics.json")
    return sorted(p.parent for p in found if (p.parent / "config.json").exists())


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "not reached"
    if key.endswith("accuracy"):
        return f"{value:.2%}"
    if key == "bytes_up_per_sample":
        return f"{value / 1024:,.1f} KiB"
    if key == "compute_s_per_sample":
        return f"{value * 1e3:.3f} ms"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return str(value)


def to_markdown(rows: Sequence[dict[str, Any]], *, target: float) -> str:
    """Render the rows as a markdown table."""
    header = [title.format(target=target) for _, title in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(k, row[k]) for k, _ in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    """Summarise the runs under a folder and write the comparison files."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="multirun folder (or any folder of runs)")
    parser.add_argument("--target", type=float, default=0.95, help="accuracy to reach")
    args = parser.parse_args(argv)
    runs = find_runs(args.root)
    if not runs:
        raise SystemExit(f"no run folders (config.json + metrics.json) under {args.root}")
    rows = [summarise_run(run, target=args.target) for run in runs]
    table = to_markdown(rows, target=args.target)
    (args.root / "comparison.md").write_text(table)
    with open(args.root / "comparison.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(table, end="")


if __name__ == "__main__":
    main()
