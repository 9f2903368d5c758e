"""The clock's oracle: the best per-device cuts, found on the virtual clock itself.

A planner's plan is only as good as its cost model. To say how much a per-device plan
can gain on a fleet at all, the oracle does not predict: it takes each device's round as
the clock charged it in the runs at every uniform cut (same seed, so the same data,
devices and failures), and for each round plays out every assignment of cuts to the
devices (:func:`server.clock.device_rounds`, :func:`splitlearn.planning.queue.round_seconds`,
as the clock itself does). The least is the oracle's round. Devices that did not
finish in all of those runs' rounds are left out of that round's comparison. Small
fleets only: ``K ** n`` assignments a round (4,096 for 4 cuts and 6 devices).
"""

from __future__ import annotations

import csv
import itertools
import json
from collections.abc import Mapping
from pathlib import Path

from server.clock import device_rounds
from splitlearn.planning.queue import DeviceRound, round_seconds

#: Assignments played out per round at most.
MAX_ASSIGNMENTS = 4096


def rounds_of(run_dir: Path) -> dict[int, dict[str, DeviceRound]]:
    """Return round -> device (partition id) -> its round as the clock charged it."""
    with open(run_dir / "clients.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    found = {}
    for metrics in json.loads((run_dir / "metrics.json").read_text()):
        number = int(metrics["round"])
        done = sorted((r for r in rows if int(r["round"]) == number and r["status"] == "ok"),
                      key=lambda r: int(r["node_id"]))
        if done:
            played = device_rounds(done, trunk_s=float(metrics.get("trunk_s", 0.0)))
            found[number] = {str(r["client"]): p for r, p in zip(done, played, strict=True)}
    return found


def oracle(uniform: Mapping[int, Path], others: Mapping[str, Path] | None = None
           ) -> dict[str, float]:
    """Return the summed rounds of the oracle, of every uniform cut and of ``others``.

    Every sum is over the same rounds and devices: those every run finished. Also
    ``gain_vs_best_uniform`` (1 - oracle / the best uniform cut's) and, for each of
    ``others`` (e.g. a planner's run of the same seed), its own gain over that cut.
    """
    cuts = sorted(uniform)
    runs = {**{c: rounds_of(d) for c, d in uniform.items()},
            **{name: rounds_of(d) for name, d in (others or {}).items()}}
    sums = dict.fromkeys([*runs, "oracle"], 0.0)
    for number in sorted(set.intersection(*(set(r) for r in runs.values()))):
        devices = sorted(set.intersection(*(set(r[number]) for r in runs.values())))
        if not devices:
            continue
        if len(cuts) ** len(devices) > MAX_ASSIGNMENTS:
            raise ValueError(f"{len(devices)} devices x {len(cuts)} cuts: too many assignments "
                             f"for the oracle (at most {MAX_ASSIGNMENTS})")
        for key, run in runs.items():
            sums[key] += round_seconds([run[number][d] for d in devices])
        sums["oracle"] += min(
            round_seconds([runs[c][number][d] for d, c in zip(devices, combo, strict=True)])
            for combo in itertools.product(cuts, repeat=len(devices)))
    best = min(sums[c] for c in cuts)
    summary = {f"cut={k}_s" if k in cuts else f"{k}_s": v for k, v in sums.items()}
    for key in ["oracle", *(others or {})]:
        summary[f"{key}_gain_vs_best_uniform"] = 1 - sums[key] / best if best > 0 else 0.0
    return summary
