"""The prepared accelerator check: ``python -m benchmarks gpu`` (about 7 minutes on one GPU).

Time on a GPU machine is short and shared, so this is one command that runs every part in
turn and writes ``gpu.json`` after each (a part that fails records its error; the next one
runs). Every figure carries the device's name.

1. ``tests``: ``pytest -m cuda`` (the trunk on CUDA against the trunk on the CPU).
2. ``default``: the default job with the trunk on the device and on the CPU (``server.device``):
   final test accuracy and steady seconds per round (rounds 2+).
3. ``resnet18``: ResNet-18 at 32x32 (digits resized: nothing is downloaded), SplitFed v2 with
   16 and 64 simulated devices and the trunk on the device, as a fraction of the same network,
   batch and optimiser trained centrally on the device (one process). A run whose accuracy is
   below ``--floor`` is reported as not learning, and gets no fraction.
4. ``serve``: the trunk alone on the device serving 1 to 1,024 synthetic devices over loopback
   gRPC (ResNet-18's trunk above ``--cut``, batches of 32), with ``batch_concurrent`` off and
   on and the forward in fp32 and bf16: samples/s and p50/p95 ms per batch, and the most
   devices served at p95 under 50 ms. Devices are threads in ``--client-processes`` processes;
   the guard is off (the devices' rows are noise).

``--device cpu --quick`` rehearses every part on a CPU at small sizes (the command a session
without a GPU checks). Results land in ``outputs/bench/gpu-<time>/`` (``gpu.json``,
``gpu.md``); the last line printed is the JSON.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

#: Parts in the order they run.
PARTS = ("tests", "default", "resnet18", "serve")
#: The latency the serving part counts devices under.
P95_BUDGET_MS = 50.0
DEVICES = (1, 4, 16, 64, 256, 1024)
RESNET = ("model=resnet18", "dataset.image_size=32", "strategy.num_rounds=4", "logger=none",
          "checkpoint=false")


def device_name(device: str) -> str:
    """Return the accelerator's own name (the CPU's model on a CPU)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return device


# --- 1. the CUDA tests ---------------------------------------------------------------------------


def part_tests(device: str, quick: bool) -> dict[str, Any]:
    """Run the tests marked ``cuda``; return their outcome line and exit status."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p",
                           "no:cacheprovider", "tests/unit/test_accelerators.py"],
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return {"returncode": proc.returncode, "summary": lines[-1] if lines else proc.stderr[-500:]}


# --- 2. the default job --------------------------------------------------------------------------


def simulated(overrides: Sequence[str]) -> list[dict]:
    """Run a job through Flower's Simulation Engine; return its metrics per round."""
    from benchmarks.overhead import run_flower
    from protocols import compose_config

    return run_flower(compose_config([*overrides]))


def steady_round_s(rounds: Sequence[dict]) -> float:
    """Mean training seconds of rounds 2+ (round 1 holds the start-up)."""
    steady = [r["round_train_s"] for r in rounds if r.get("round", 0) >= 2 and
              "round_train_s" in r]
    return statistics.mean(steady) if steady else math.nan


def part_default(device: str, quick: bool) -> dict[str, Any]:
    """Run the default job with the trunk on ``device``, then on the CPU."""
    rows = {}
    for where in dict.fromkeys([device, "cpu"]):
        extra = ["strategy.num_rounds=3"] if quick else []
        rounds = simulated(["logger=none", "checkpoint=false", f"server.device={where}",
                            *extra])
        rows[where] = {"test_accuracy": rounds[-1]["test_accuracy"],
                       "round_s": steady_round_s(rounds), "rounds": rounds[-1]["round"]}
        print(f"default job, trunk on {where}: {rows[where]}", flush=True)
    return rows


# --- 3. ResNet-18 against central training on the device -----------------------------------------


def central_on(overrides: Sequence[str], device: str, *, epochs: int) -> dict[str, float]:
    """Train the job's whole network on ``device`` alone; samples/s over epochs 2+."""
    from torch.utils.data import DataLoader

    from protocols import compose_config
    from splitlearn.config import to_object
    from splitlearn.data import held_out_dataset, load_client_data
    from splitlearn.evaluation import evaluate_model
    from splitlearn.models.factory import build_model_from_config
    from splitlearn.optim import build_optimizer

    cfg = compose_config([*overrides])
    dataset, strategy = to_object(cfg.dataset), to_object(cfg.strategy)
    data = load_client_data(dataset=dataset.name, partition_id=0, num_partitions=1,
                            partitioner="iid", seed=cfg.seed, path=dataset.path,
                            image_size=dataset.image_size)
    place = torch.device(device)
    model = build_model_from_config(to_object(cfg.model), dataset, seed=cfg.seed).to(place)
    optimizer = build_optimizer(model.parameters(), strategy, "device", torch_only=True)
    loader = DataLoader(data, batch_size=strategy.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(cfg.seed))
    times, seen = [], []
    for _ in range(epochs):
        started, count = time.perf_counter(), 0
        for x, y in loader:
            x, y = x.to(place, non_blocking=True), y.to(place, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            count += len(y)
        if place.type == "cuda":
            torch.cuda.synchronize(place)
        times.append(time.perf_counter() - started)
        seen.append(count)
    _, accuracy, _ = evaluate_model(model, DataLoader(held_out_dataset(dataset, seed=cfg.seed),
                                                      batch_size=512), device=place)
    return {"samples_per_s": sum(seen[1:]) / sum(times[1:]), "test_accuracy": accuracy}


def part_resnet18(device: str, quick: bool, *, floor: float) -> dict[str, Any]:
    """SplitFed v2 with the trunk on ``device`` at 16 and 64 devices, against central."""
    from benchmarks.overhead import fraction_of, steady_samples_per_s

    counts = (4,) if quick else (16, 64)
    extra = ["strategy.num_rounds=3"] if quick else []
    central = central_on([*RESNET, *extra], device, epochs=3 if quick else 4)
    print(f"ResNet-18 central on {device}: {central}", flush=True)
    rows = []
    for clients in counts:
        rounds = simulated([*RESNET, *extra, f"num_clients={clients}",
                            f"strategy.min_train_nodes={min(clients, 2)}",
                            f"server.device={device}"])
        accuracy = rounds[-1]["test_accuracy"]
        row: dict[str, Any] = {"clients": clients, "test_accuracy": accuracy,
                               "samples_per_s": steady_samples_per_s(rounds)}
        fraction = fraction_of(row, central["samples_per_s"],
                               central_accuracy=central["test_accuracy"], floor=floor)
        if fraction is not None:
            row["fraction_of_central"] = fraction
        else:  # a throughput of training that does not learn is not a figure
            row["not_learning"] = f"accuracy below the floor {floor}"
        rows.append(row)
        print(f"ResNet-18 SplitFed v2, {clients} devices: {row}", flush=True)
    return {"central": central, "split": rows, "floor": floor}


# --- 4. the trunk alone, serving many devices ----------------------------------------------------


def _devices_in_process(address: str, tokens: list[str], shape: tuple[int, ...], batch: int,
                        start_at: float, warmup_s: float, seconds: float,
                        conn: Connection) -> None:
    """Run one thread per token, each a device sending batches; send back their latencies."""
    from splitlearn.dataplane import GrpcTransport, TrunkChannel

    torch.set_num_threads(1)
    acts, labels = torch.rand(batch, *shape), torch.randint(0, 10, (batch,))
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def device(token: str) -> None:
        channel = TrunkChannel(GrpcTransport(address, token, max_frame_bytes=1 << 26))
        mine: list[float] = []
        try:
            measure_from, end = start_at + warmup_s, start_at + warmup_s + seconds
            while time.time() < start_at:
                time.sleep(0.001)
            while (now := time.time()) < end:
                begun = time.perf_counter()
                channel.forward(acts, labels)
                if now >= measure_from:
                    mine.append(time.perf_counter() - begun)
        except Exception as err:  # noqa: BLE001 - counted and reported, the others go on
            with lock:
                errors.append(f"{type(err).__name__}: {err}"[:200])
        finally:
            channel.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=device, args=(t,), daemon=True) for t in tokens]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    conn.send((latencies, errors))


def serve_once(device: str, *, devices: int, batching: bool, precision: str, cut: int,
               processes: int, seconds: float, warmup_s: float = 1.0,
               batch: int = 32) -> dict[str, Any]:
    """Serve ``devices`` synthetic devices for ``seconds``; return throughput and latency."""
    from protocols.splitfed import SplitFedV2Options
    from server.standalone import build_trunk_side
    from splitlearn.config import DataPlaneConfig, GuardConfig, ServerConfig
    from splitlearn.dataplane import TrunkService
    from splitlearn.models import build_model

    model = build_model("resnet18", in_channels=3, image_size=32, num_classes=10, seed=0)
    shape = model.cut_shape(cut)
    dataplane = DataPlaneConfig(max_frame_bytes=1 << 26, max_streams=4 * devices + 64,
                                max_batch=batch * devices, guard=GuardConfig(enabled=False))
    options = SplitFedV2Options(lr=0.01, momentum=0.0, batch_concurrent=batching,
                                barrier_timeout_s=0.005)
    side = build_trunk_side(model, options, dataplane,
                            server=ServerConfig(device=device, precision=precision))
    service = TrunkService(side.endpoint, host="127.0.0.1", port=0,
                           max_streams=dataplane.max_streams)
    service.start()
    tokens = [side.tokens.issue(client=f"d{i}", protocol="splitfed_v2", cut=cut,
                                server_round=1, ttl_s=3600) for i in range(devices)]
    context = multiprocessing.get_context("spawn")
    count = max(1, min(processes, devices))
    start_at = time.time() + 4.0 + 0.01 * devices  # every process started and connected
    pipes, workers = [], []
    for index in range(count):
        parent, child = context.Pipe()
        worker = context.Process(target=_devices_in_process, daemon=True, args=(
            service.address, tokens[index::count], shape, batch, start_at, warmup_s, seconds,
            child))
        worker.start()
        pipes.append(parent)
        workers.append(worker)
    latencies: list[float] = []
    errors: list[str] = []
    try:
        for parent in pipes:
            got, failed = parent.recv()
            latencies += got
            errors += failed
    finally:
        for worker in workers:
            worker.join(30)
        service.stop(0)
    ms = sorted(x * 1e3 for x in latencies)
    return {"devices": devices, "batching": batching, "precision": precision,
            "samples_per_s": len(ms) * batch / seconds,
            "p50_ms": statistics.median(ms) if ms else math.nan,
            "p95_ms": ms[int(0.95 * (len(ms) - 1))] if ms else math.nan,
            "batches": len(ms), "errors": len(errors), "first_error": errors[:1]}


def part_serve(device: str, quick: bool, *, cut: int, processes: int) -> dict[str, Any]:
    """Every device count, batching off and on, fp32 and bf16; the most served in budget."""
    counts = (1, 4) if quick else DEVICES
    seconds = 1.0 if quick else 3.0
    rows = []
    for precision in ("fp32", "bf16"):
        for batching in (False, True):
            for devices in counts:
                row = serve_once(device, devices=devices, batching=batching,
                                 precision=precision, cut=cut, processes=processes,
                                 seconds=seconds)
                rows.append(row)
                print(f"serve: {row}", flush=True)
    within = [r for r in rows if r["p95_ms"] < P95_BUDGET_MS and not r["errors"]]
    best = max(within, key=lambda r: (r["devices"], r["samples_per_s"]), default=None)
    return {"cut": cut, "rows": rows, "p95_budget_ms": P95_BUDGET_MS,
            "most_devices_within_budget": best}


# --- the suite -----------------------------------------------------------------------------------


def bench_gpu(overrides: Sequence[str], *, device: str = "cuda", quick: bool = False,
              parts: Sequence[str] = PARTS, floor: float = 0.5, cut: int = 4,
              client_processes: int | None = None, out_dir: Path | None = None
              ) -> dict[str, Any]:
    """Run the parts in order; write ``gpu.json`` and ``gpu.md`` after each; return the results.

    Raises
    ------
    ValueError
        ``device`` is not on this machine (named as ``server.device`` would name it).
    """
    from splitlearn.accelerators import resolve_device

    resolve_device(device)  # refuses a device this machine lacks before anything runs
    if overrides:
        raise ValueError(f"gpu takes no Hydra overrides (got {list(overrides)}): its jobs are "
                         "fixed so that runs on different machines compare")
    out_dir = out_dir or Path("outputs/bench") / time.strftime("gpu-%Y-%m-%d-%H-%M-%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    processes = client_processes or max(1, min(8, (os.cpu_count() or 2) // 2))
    results: dict[str, Any] = {"device": device, "device_name": device_name(device),
                               "torch": torch.__version__, "quick": quick, "parts": {}}
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "tests": lambda: part_tests(device, quick),
        "default": lambda: part_default(device, quick),
        "resnet18": lambda: part_resnet18(device, quick, floor=floor),
        "serve": lambda: part_serve(device, quick, cut=cut, processes=processes),
    }
    for name in parts:
        started = time.perf_counter()
        print(f"== {name} on {results['device_name']}", flush=True)
        try:
            outcome = runners[name]()
        except Exception as err:  # noqa: BLE001 - recorded: the next part still runs
            outcome = {"error": f"{type(err).__name__}: {err}",
                       "traceback": traceback.format_exc()[-2000:]}
            print(f"{name} failed: {outcome['error']}", flush=True)
        results["parts"][name] = outcome | {"seconds": time.perf_counter() - started}
        (out_dir / "gpu.json").write_text(json.dumps(results, indent=2, default=str))
        (out_dir / "gpu.md").write_text(summary_markdown(results))
    print(f"results: {out_dir}", flush=True)
    print(json.dumps(results, default=str))
    return results


def summary_markdown(results: dict[str, Any]) -> str:
    """Return the results as a page (what each part measured, on which device)."""
    lines = [f"# Accelerator check on {results['device_name']} (`{results['device']}`)", "",
             f"torch {results['torch']}{', quick rehearsal' if results['quick'] else ''}.", ""]
    parts = results["parts"]
    if "tests" in parts:
        lines += [f"- `pytest -m cuda`: {parts['tests'].get('summary', parts['tests'])}", ""]
    if "default" in parts and "error" not in parts["default"]:
        lines += ["| default job, trunk on | test accuracy | s per round (2+) |",
                  "| --- | ---: | ---: |"]
        lines += [f"| {k} | {v['test_accuracy']:.4f} | {v['round_s']:.2f} |"
                  for k, v in parts["default"].items() if isinstance(v, dict)]
        lines.append("")
    resnet = parts.get("resnet18", {})
    if "split" in resnet:
        central = resnet["central"]
        lines += [f"ResNet-18 central on the device: {central['samples_per_s']:.0f} samples/s, "
                  f"accuracy {central['test_accuracy']:.3f}.", "",
                  "| devices | samples/s | accuracy | fraction of central |",
                  "| ---: | ---: | ---: | ---: |"]
        for r in resnet["split"]:
            fraction = (f"{r['fraction_of_central']:.2f}" if "fraction_of_central" in r
                        else r["not_learning"])
            lines.append(f"| {r['clients']} | {r['samples_per_s']:.0f} | "
                         f"{r['test_accuracy']:.3f} | {fraction} |")
        lines.append("")
    serve = parts.get("serve", {})
    if "rows" in serve:
        lines += [f"Trunk alone above cut {serve['cut']}, batches of 32:", "",
                  "| precision | batching | devices | samples/s | p50 ms | p95 ms | errors |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['precision']} | {'on' if r['batching'] else 'off'} | {r['devices']} | "
                  f"{r['samples_per_s']:.0f} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | "
                  f"{r['errors']} |" for r in serve["rows"]]
        best = serve["most_devices_within_budget"]
        lines += ["", f"Most devices at p95 under {serve['p95_budget_ms']:.0f} ms: "
                  + (f"{best['devices']} ({best['precision']}, batching "
                     f"{'on' if best['batching'] else 'off'})" if best else "none"), ""]
    failed = [f"- {k}: {v['error']}" for k, v in parts.items() if "error" in v]
    return "\n".join(lines + (["Failed parts:", *failed, ""] if failed else []))
