"""The planner benchmark: virtual time to a target accuracy, uniform cuts vs planners.

``python -m benchmarks planner [--seeds N] [--first-seed S] [--target ACC]
[--scenarios ...] [--methods ...] [--oracle-clients 6] [overrides ...]``

For each scenario (``+scenario=heterogeneous``, ``+scenario=dynamic`` and
``+scenario=wide_spread``) and seed, the same run is trained once per uniform cut and
once per planner (greedy, DynSL, SmartSplit) through the shipped strategy, ClientApp and trunk
(:func:`experiments.local.run_local`), and the virtual clock says when each
first reached the target test accuracy. The host's FLOP/s are measured once and
fixed for every run, so the clock converts every run's compute the same way.

Accuracy is compared two ways. At equal rounds: each method's test accuracy
after the configured rounds. At equal virtual time: every method trains for at
least the virtual time the best uniform cut took for its rounds (a planner
whose rounds are shorter, e.g. because it selects devices, runs more rounds),
and its accuracy there is the mean over its last three evaluations by that
time (one evaluation swings by a point or two under label skew). The second is
the fair one for planners that trade clients per round for shorter rounds.

It also checks the planner itself (its makespan against brute force on random
instances of up to 6 clients x 6 cuts, and the time to plan 1,000 clients x 20
cuts) and writes ``planner.csv``, ``planner.json``, ``planner.png`` and
``curves.json`` into the output folder (per run, each round's virtual time and accuracy,
its plan error, and the plan it ran: every device's cut or status, :func:`round_cuts`).
The last line printed is JSON with the reductions of the best planner's time to
target versus the best and the worst uniform cut and versus greedy (the worst case
over the scenarios), plus final accuracies; the summary also has each planner's own
reduction, and each planner's predicted rounds against the
clock's (``plan_error``). With ``--oracle-clients N`` (N <= 6) it also runs every
uniform cut and DynSL on an N-device version of each scenario and finds the clock's
oracle there (:mod:`benchmarks.clock_oracle`): how much per-device cuts can gain on
that fleet at all, and how much of it DynSL gets.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from protocols import compose_config

#: The ResNet-style network on digits resized to 16x16; 15 rounds.
PLANNER_DEFAULTS = (
    "model=resnet",
    "dataset.image_size=16",
    "strategy.num_rounds=15",
    "logger=none",
)
SCENARIOS = ("heterogeneous", "dynamic", "wide_spread")
PLANNERS = ("greedy", "dynsl", "smartsplit")
#: SmartSplit's cuts and recomputation with a random choice among the feasible devices: what
#: its selection is worth at equal virtual time (not one of the planners compared above).
RANDOM_SELECTION = "smartsplit-random"


@dataclass(frozen=True)
class RunResult:
    """One training run's outcome on the virtual clock."""

    scenario: str
    seed: int
    method: str  # "cut=K" for a uniform cut, else the planner's name
    time_to_target_s: float  # inf when the target was never reached
    virtual_time_s: float  # the whole run's
    final_accuracy: float
    best_accuracy: float
    max_memory_over_budget: float  # measured peak / budget, worst client-round (0: none)
    curve: tuple[tuple[float, float], ...] = ()  # (virtual time, test accuracy) per round
    rounds: int = 0
    accuracy_at_budget: float = math.nan  # mean of the last evaluations by the time budget
    plan_errors: tuple[tuple[int, float], ...] = ()  # (round, predicted / clock - 1)
    cuts: tuple[str, ...] = ()  # per round, each device's cut or status (round_cuts)
    rounds_to_target: float = math.inf  # the first round reaching the target (inf: none)


def _first_at_target(history: Sequence[dict], target: float) -> dict | None:
    """Return the first trained round's row reaching ``target`` (None if none)."""
    return next((row for row in history
                 if row["round"] >= 1 and row["test_accuracy"] >= target), None)


def time_to_target(history: Sequence[dict], target: float) -> float:
    """Virtual seconds at the end of the first round reaching ``target`` (inf if none)."""
    row = _first_at_target(history, target)
    return math.inf if row is None else float(row["virtual_time_s"])


def rounds_to_target(history: Sequence[dict], target: float) -> float:
    """Return the first round reaching ``target`` (inf if none)."""
    row = _first_at_target(history, target)
    return math.inf if row is None else float(row["round"])


def implied_learning_penalty(results: Sequence[RunResult], cuts: Sequence[int]) -> float | None:
    """Mean rounds to target at the deepest uniform cut over those at the shallowest, - 1.

    What ``planner.learning_penalty`` stands for on this scenario's runs (None: a cut
    missing, or one never reached the target).
    """
    def mean_rounds(cut: int) -> float | None:
        rounds = [r.rounds_to_target for r in results if r.method == f"cut={cut}"]
        return statistics.fmean(rounds) if rounds and all(map(math.isfinite, rounds)) else None

    shallow, deep = mean_rounds(min(cuts)), mean_rounds(max(cuts))
    return None if shallow is None or deep is None else deep / shallow - 1.0


def run_once(scenario: str, seed: int, method: str, overrides: Sequence[str], *,
             host_flops: dict[int, float], target: float, rounds: int | None = None,
             run_dir: Path | None = None) -> RunResult:
    """Train one configuration in this process (``rounds``: override the round count).

    ``run_dir``: where its run folder is kept (else a temporary one).
    """
    from experiments.local import run_local

    if method.startswith("cut="):
        choice = [f"model.cut={method[4:]}"]
    elif method == RANDOM_SELECTION:
        choice = ["planner=smartsplit", "planner.selection=random"]
    else:
        choice = [f"planner={method}"]
    by_cut = "{" + ", ".join(f"{c}: {f}" for c, f in host_flops.items()) + "}"
    if rounds is not None:
        choice.append(f"strategy.num_rounds={rounds}")
    cfg = compose_config([f"+scenario={scenario}", *PLANNER_DEFAULTS, *overrides, *choice,
                          f"seed={seed}", f"devices.host_flops_per_s={min(host_flops.values())}",
                          f"+devices.host_flops_by_cut={by_cut}"])
    torch.set_num_threads(cfg.engine.torch_threads)
    # A folder of its own when none is given, read before it goes (the plan each round ran).
    folder = nullcontext(str(run_dir)) if run_dir else tempfile.TemporaryDirectory(
        prefix="planner-run-")
    with folder as path:
        cfg.run_dir = path
        result = run_local(cfg, concurrency=2)
        cuts = round_cuts(Path(path) / "clients.csv")
    history = result.history
    final = history[-1]
    return RunResult(
        scenario, seed, method, time_to_target(history, target), float(final["virtual_time_s"]),
        float(final["test_accuracy"]), max(float(r["test_accuracy"]) for r in history),
        max((float(r.get("memory_over_budget", 0.0)) for r in history), default=0.0),
        tuple((float(r["virtual_time_s"]), float(r["test_accuracy"])) for r in history),
        rounds=int(final["round"]),
        plan_errors=tuple((int(r["round"]), float(r["plan_error"])) for r in history
                          if "plan_error" in r),
        cuts=cuts, rounds_to_target=rounds_to_target(history, target),
    )


def round_cuts(clients_csv: Path) -> tuple[str, ...]:
    """Return each round's plan as it ran: a character per device, in partition order.

    The device's cut where it trained (``ok``), else the first letter of its status
    (``u``: unavailable, ``d``: dropped, ``m``: memory, ...); ``-`` where it had no row.
    """
    with open(clients_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    devices = sorted({int(r["partition_id"]) for r in rows})
    by_round: dict[int, dict[int, str]] = {}
    for row in rows:
        mark = row["cut"] if row["status"] == "ok" and row["cut"] else row["status"][:1]
        by_round.setdefault(int(row["round"]), {})[int(row["partition_id"])] = mark
    return tuple("".join(marks.get(d, "-") for d in devices)
                 for _, marks in sorted(by_round.items()))


def run_for_budget(scenario: str, seed: int, method: str, overrides: Sequence[str], *,
                   host_flops: dict[int, float], target: float, rounds: int,
                   budget_s: float) -> RunResult:
    """Train ``rounds`` rounds, or more if they end before ``budget_s`` of virtual time.

    The longer run replaces the first (a run is not repeatable to the bit with
    two clients in flight, so the two are not spliced).
    """
    result = run_once(scenario, seed, method, overrides, host_flops=host_flops, target=target)
    if 0 < result.virtual_time_s < budget_s:
        more = math.ceil(rounds * budget_s / result.virtual_time_s) + 1
        result = run_once(scenario, seed, method, overrides, host_flops=host_flops,
                          target=target, rounds=more)
        result = replace(result, final_accuracy=accuracy_after(result, rounds))
    return at_budget(result, budget_s)


def at_budget(result: RunResult, budget_s: float, *, last: int = 3) -> RunResult:
    """Fill in the mean accuracy of the last ``last`` evaluations by ``budget_s``."""
    by_then = [a for t, a in result.curve[1:] if t <= budget_s * (1 + 1e-9)]
    accuracy = statistics.fmean(by_then[-last:]) if by_then else 0.0
    return replace(result, accuracy_at_budget=accuracy)


def accuracy_after(result: RunResult, rounds: int) -> float:
    """Test accuracy after ``rounds`` rounds (the last one if the run was shorter)."""
    return result.curve[min(rounds, len(result.curve) - 1)][1]


def mean_time(results: Sequence[RunResult]) -> float:
    """Mean time to target over seeds (inf if any seed never reached it)."""
    return statistics.fmean(r.time_to_target_s for r in results)


def summarise(results: Sequence[RunResult], cuts: Sequence[int]) -> dict:
    """Per scenario: each method's mean time and accuracy; the best planner's reductions."""
    summary: dict = {}
    for scenario in sorted({r.scenario for r in results}):
        mine = [r for r in results if r.scenario == scenario]
        methods = sorted({r.method for r in mine})
        times = {m: mean_time([r for r in mine if r.method == m]) for m in methods}
        finals = {m: statistics.fmean(r.final_accuracy for r in mine if r.method == m)
                  for m in methods}
        at_time = {m: statistics.fmean(r.accuracy_at_budget for r in mine if r.method == m)
                   for m in methods}
        uniform = {f"cut={c}": times[f"cut={c}"] for c in cuts if f"cut={c}" in times}
        planners = {m: times[m] for m in PLANNERS if m in times}
        best_planner = min(planners, key=planners.get)  # type: ignore[arg-type]
        best_uniform = min(uniform, key=uniform.get)  # type: ignore[arg-type]
        worst_uniform = max(uniform, key=uniform.get)  # type: ignore[arg-type]
        rounds = {m: statistics.fmean(r.rounds_to_target for r in mine if r.method == m)
                  for m in methods}
        summary[scenario] = {
            "time_to_target_s": times, "rounds_to_target": rounds, "final_accuracy": finals,
            # What the deepest cut's runs say of learning_penalty (DynSL's weight of depth).
            "implied_learning_penalty": implied_learning_penalty(mine, cuts),
            "accuracy_at_equal_time": at_time,
            "best_planner": best_planner, "best_uniform": best_uniform,
            "worst_uniform": worst_uniform,
            "reduction_vs_best_uniform": reduction(planners[best_planner], uniform[best_uniform]),
            "reduction_vs_worst_uniform": reduction(planners[best_planner],
                                                    uniform[worst_uniform]),
            "reduction_vs_greedy": reduction(planners[best_planner], planners.get("greedy")),
            # Each planner's own, against the best uniform cut (time to target).
            "reduction_vs_best_uniform_by_planner": {
                m: reduction(t, uniform[best_uniform]) for m, t in planners.items()},
            "accuracy_gap_vs_best_uniform": at_time[best_planner] - at_time[best_uniform],
            "accuracy_gap_at_equal_rounds": finals[best_planner] - finals[best_uniform],
            # SmartSplit's selection against a random choice among the feasible devices.
            "selection_vs_random_at_equal_time": {
                m: at_time[m] for m in ("smartsplit", RANDOM_SELECTION) if m in at_time},
            "max_memory_over_budget": max(r.max_memory_over_budget for r in mine),
            # How well each planner's cost model predicted the rounds the clock charged.
            "plan_error": {m: errors for m in methods
                           if (errors := plan_error_summary(
                               [r for r in mine if r.method == m]))},
        }
    return summary


#: Rounds planned before every device has reported (with the planner's prior).
PRIOR_ROUNDS = 2


def plan_error_summary(results: Sequence[RunResult]) -> dict[str, float]:
    """Median and worst relative error of the predicted round against the clock's.

    ``worst_abs_measured`` leaves out the first :data:`PRIOR_ROUNDS` rounds, planned
    before the devices measured themselves (a device unavailable in round 1 is planned
    as the prior in round 2).
    """
    signed = [e for r in results for _, e in r.plan_errors]
    if not signed:
        return {}
    later = [abs(e) for r in results for n, e in r.plan_errors if n > PRIOR_ROUNDS]
    return {"median_abs": statistics.median(abs(e) for e in signed),
            "worst_abs": max(abs(e) for e in signed),
            "worst_abs_measured": max(later, default=math.nan),
            "median_signed": statistics.median(signed), "rounds": len(signed)}


def reduction(mine: float, other: float | None) -> float | None:
    """Fraction of ``other``'s time that ``mine`` saves (None when undefined)."""
    if other is None or not math.isfinite(mine):
        return None
    if not math.isfinite(other):
        return 1.0  # the other never reached the target
    return 1.0 - mine / other


def check_solver(*, instances: int = 200, seed: int = 0) -> dict:
    """Check the exact solver against brute force on small instances; time 1,000 x 20."""
    from splitlearn.planning.solve import brute_force, random_instance, solve, time_planner

    worst_gap = 0.0
    for i in range(instances):
        clients, cuts, trunk = random_instance(1 + i % 6, 1 + (i // 6) % 6, seed=seed + i)
        exact = solve(clients, cuts, trunk_flops_per_s=trunk, allow_recompute=False)
        brute = brute_force(clients, cuts, trunk_flops_per_s=trunk, allow_recompute=False)
        if brute.makespan_s > 0:
            worst_gap = max(worst_gap, exact.makespan_s / brute.makespan_s - 1.0)
    return {"instances": instances, "worst_gap_vs_brute_force": worst_gap,
            "plan_1000x20_s": time_planner(1000, 20, seed=seed)}


def plot(results: Sequence[RunResult], path: Path, *, target: float) -> None:
    """Per scenario: mean time to target per method (bars), accuracy over virtual time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = sorted({r.scenario for r in results})
    fig, axes = plt.subplots(2, len(scenarios), figsize=(7 * len(scenarios), 8), squeeze=False)
    for column, scenario in enumerate(scenarios):
        mine = [r for r in results if r.scenario == scenario]
        methods = sorted({r.method for r in mine}, key=lambda m: (not m.startswith("cut="), m))
        colors = dict(zip(methods, plt.get_cmap("tab10").colors, strict=False))
        bars, curves = axes[0][column], axes[1][column]
        times = [mean_time([r for r in mine if r.method == m]) for m in methods]
        bars.bar(methods, [t if math.isfinite(t) else 0.0 for t in times],
                 color=[colors[m] for m in methods])
        for x, t in enumerate(times):
            if not math.isfinite(t):
                bars.text(x, 0, "never", ha="center", va="bottom", rotation=90)
        bars.set_title(f"{scenario}: virtual time to {target:.0%} (mean of seeds)")
        bars.set_ylabel("virtual seconds")
        bars.tick_params(axis="x", rotation=30)
        for r in mine:
            curves.plot([t for t, _ in r.curve], [a for _, a in r.curve], color=colors[r.method],
                        alpha=0.6, label=r.method if r.seed == 0 else None)
        curves.axhline(target, color="gray", linestyle=":")
        curves.set_xlabel("virtual seconds")
        curves.set_ylabel("test accuracy")
        curves.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_oracle(scenario: str, seeds: Sequence[int], overrides: Sequence[str], *,
                 clients: int, cuts: Sequence[int], out_dir: Path,
                 run: Callable[..., RunResult]) -> dict:
    """DynSL against the clock's oracle on a ``clients``-device version of ``scenario``.

    Per seed: every uniform cut and DynSL, their run folders kept, and the oracle's best
    per-device cuts played out from the uniform runs (:mod:`benchmarks.clock_oracle`).
    ``share`` is the part of the oracle's gain over the best uniform cut DynSL got.
    """
    from benchmarks.clock_oracle import oracle

    small = [*overrides, f"num_clients={clients}"]
    found = {}
    for seed in seeds:
        folders = {c: out_dir / "oracle" / f"{scenario}-{seed}-cut{c}" for c in cuts}
        for c, folder in folders.items():
            run(run_once, scenario, seed, f"cut={c}", run_dir=folder, overrides=small)
        dynsl = out_dir / "oracle" / f"{scenario}-{seed}-dynsl"
        run(run_once, scenario, seed, "dynsl", run_dir=dynsl, overrides=small)
        found[seed] = oracle(folders, {"dynsl": dynsl})
    gains = {key: statistics.fmean(f[key] for f in found.values())
             for key in ("oracle_gain_vs_best_uniform", "dynsl_gain_vs_best_uniform")}
    share = (gains["dynsl_gain_vs_best_uniform"] / gains["oracle_gain_vs_best_uniform"]
             if gains["oracle_gain_vs_best_uniform"] > 0 else None)
    return {"clients": clients, "by_seed": found, **gains, "dynsl_share_of_oracle_gain": share}


def bench_planner(overrides: Sequence[str], *, seeds: int = 3, target: float = 0.9,
                  out_dir: Path | None = None, scenarios: Sequence[str] | None = None,
                  methods: Sequence[str] | None = None, first_seed: int = 0,
                  oracle_clients: int | None = None) -> dict:
    """Run every method on every scenario and seed; print and return the summary.

    ``scenarios`` and ``methods`` (planner names) narrow the run; the uniform
    cuts always run, as the reference. Seeds run from ``first_seed`` on. With
    ``oracle_clients``, also DynSL against the clock's oracle on that many devices
    (:func:`bench_oracle`).
    """
    seed_range = range(first_seed, first_seed + seeds)
    from server.app import host_flops_by_cut
    from splitlearn.config import to_object
    from splitlearn.models.factory import build_model_from_config

    base = compose_config([f"+scenario={SCENARIOS[0]}", *PLANNER_DEFAULTS, *overrides])
    model = build_model_from_config(to_object(base.model), to_object(base.dataset))
    # Measured once, so that every run's clock converts compute with the same figures; the
    # median of three sweeps, since one sweep of this VM was seen 1.8x off at some cuts.
    sweeps = [host_flops_by_cut(base, model) for _ in range(3)]
    host_flops = {cut: statistics.median(s[cut] for s in sweeps) for cut in sweeps[0]}
    cuts = model.valid_cuts
    out_dir = out_dir or Path("outputs/bench") / time.strftime("planner-%Y-%m-%d-%H-%M-%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"host GFLOP/s by cut {({c: round(f / 1e9, 2) for c, f in host_flops.items()})}; "
          f"target {target}; {seeds} seeds; results in {out_dir}", flush=True)
    results: list[RunResult] = []
    uniform = [f"cut={c}" for c in cuts]
    planners = [m for m in (*PLANNERS, RANDOM_SELECTION) if methods is None or m in methods]
    rounds = int(base.strategy.num_rounds)

    def timed(run, *args, **kwargs) -> RunResult:  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        given = kwargs.pop("overrides", overrides)
        result = run(*args, given, host_flops=host_flops, target=target, **kwargs)
        print(f"{result.scenario:>13} seed {result.seed} {result.method:>17}: time to "
              f"{target:.0%} {result.time_to_target_s:8.1f} s, accuracy after {rounds} rounds "
              f"{result.final_accuracy:.4f} ({result.rounds} rounds, "
              f"{time.perf_counter() - started:.0f} s wall)", flush=True)
        return result

    for scenario in scenarios or SCENARIOS:
        mine = [timed(run_once, scenario, seed, method)
                for seed in seed_range for method in uniform]
        # Equal time: what the best uniform cut (by mean time to target) took, per seed.
        best = min(uniform, key=lambda m: mean_time([r for r in mine if r.method == m]))
        budget = {r.seed: r.virtual_time_s for r in mine if r.method == best}
        results.extend(at_budget(r, budget[r.seed]) for r in mine)
        for seed in seed_range:
            for method in planners:
                results.append(timed(run_for_budget, scenario, seed, method, rounds=rounds,
                                     budget_s=budget[seed]))
                write_rows(results, out_dir / "planner.csv")
    summary = summarise(results, cuts) | {"solver": check_solver()}
    if oracle_clients:
        summary["oracle"] = {
            scenario: bench_oracle(scenario, seed_range, overrides, clients=oracle_clients,
                                   cuts=cuts, out_dir=out_dir, run=timed)
            for scenario in scenarios or SCENARIOS}
        print(f"oracle: {json.dumps(summary['oracle'], default=str)}")
    (out_dir / "planner.json").write_text(json.dumps(summary, indent=2, default=str))
    plot(results, out_dir / "planner.png", target=target)
    for scenario in SCENARIOS:
        if scenario in summary:
            print(f"{scenario}: accuracy at equal virtual time "
                  f"{json.dumps(summary[scenario]['accuracy_at_equal_time'])}")
            print(f"{scenario}: predicted / clock round - 1 "
                  f"{json.dumps(summary[scenario]['plan_error'])}")
    last = {key: min((s[key] for s in summary.values() if isinstance(s, dict) and key in s
                      and s[key] is not None), default=None)
            for key in ("reduction_vs_best_uniform", "reduction_vs_worst_uniform",
                        "reduction_vs_greedy")}
    for key in ("accuracy_gap_vs_best_uniform", "accuracy_gap_at_equal_rounds"):
        last[key] = min(summary[s][key] for s in SCENARIOS if s in summary)
    last |= {"solver_worst_gap": summary["solver"]["worst_gap_vs_brute_force"],
             "plan_1000x20_s": summary["solver"]["plan_1000x20_s"]}
    for scenario in SCENARIOS:
        print(f"{scenario}: {json.dumps(summary.get(scenario), default=str)}")
    print(json.dumps(last))
    return summary


def write_rows(results: Sequence[RunResult], path: Path) -> None:
    """One CSV row per run."""
    rows = [{k: v for k, v in asdict(r).items() if k not in ("curve", "plan_errors", "cuts")}
            for r in results]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    curves = [{"scenario": r.scenario, "seed": r.seed, "method": r.method, "curve": r.curve,
               "plan_errors": r.plan_errors, "cuts": r.cuts} for r in results]
    path.with_name("curves.json").write_text(json.dumps(curves))
