"""Benchmarks (numbers, not tests): ``python -m benchmarks NAME [overrides ...]``.

``scale``
    Time per training sample and peak memory of ``+scenario=large_scale`` (10
    clients per round, 64 synthetic examples each) with 10 to 10,000 registered
    clients (``--clients``): the ServerApp process and the whole process tree
    (Ray workers included), sampled from /proc; see :mod:`benchmarks.scale`.

``overhead``
    SplitFed v2's samples/s through the real stack (Flower Simulation Engine,
    ClientApps in Ray actors, gRPC data plane) as a fraction of the same network
    trained centrally, data-parallel on every core, for ``--clients`` and
    ``--workers`` (``dataplane.trunk_workers``); steady state (rounds 2+). The
    last line is JSON with ``fraction_of_central``; see
    :mod:`benchmarks.overhead`.

``clock``
    Per-client wall time of emulated devices (``devices.emulate=true``) against
    the virtual clock's prediction, on ``+scenario=heterogeneous``.

``memory``
    Measured peak training memory of the client side at every cut (recomputed)
    against the whole model on the device: ResNet-18 at 32x32, batch 32.

``rounds``
    The default job's seconds per steady round (rounds 2+) and their budget:
    Flower and Ray, client set-up, compute, the data plane and trunk,
    evaluation, what happens between rounds (``--repeats`` runs, each beside one
    without W&B and checkpoints); see :mod:`benchmarks.rounds`.

``defences``
    The trunk's defences (its guard, capped example counts) on against off in honest
    runs of the default job and ``+scenario=heterogeneous``, alternating, ``--repeats``
    each: final accuracy, seconds per round, what the guard refused; see
    :mod:`benchmarks.defences`.

``communication``
    Bytes per training sample of every protocol against FedAvg: measured runs
    against the closed forms, and who wins where as the model and the data per
    client grow; see :mod:`benchmarks.communication`.

``latency``
    Data-plane round trip per batch by payload size against a raw gRPC stream
    of the same bytes; see :mod:`benchmarks.latency`.

``compression``
    Bytes moved per training sample against final accuracy for every
    compression method at the cut, and top-k with error feedback, on the SmallCNN
    and the ResNet-style network (``--seeds``; ``--methods none topk ...`` for some
    only); see :mod:`benchmarks.compression`.

``planner``
    Virtual time to a target accuracy for every uniform cut and for the greedy,
    DynSL and SmartSplit planners on ``+scenario=heterogeneous`` and
    ``+scenario=dynamic`` (``--seeds``, ``--target``, ``--scenarios``,
    ``--methods``); see
    :mod:`benchmarks.planner`. The last line is JSON with the reductions.

``executorch``
    The client step exported to ExecuTorch and run by its runtime, against eager
    PyTorch: time per step. The last line is the worst ratio.

``tls``
    Per-batch round trip over the data plane on loopback, plaintext vs TLS, for
    three payload sizes (the trunk's step included). The last line is the worst ratio.

``executorch-rounds``
    A ClientApp round with ``devices.runtime=executorch`` against ``eager`` (SplitFed v1,
    cnn and lenet5); see :mod:`benchmarks.executorch_rounds`.

``netns``
    (root) A real SuperNode in a network namespace behind a veth shaped by ``tc tbf``
    to a device preset's links, 3 rounds of the default job; the virtual clock's
    prediction per client-round against wall time; see :mod:`benchmarks.netns`.

``trunk``
    The trunk's training step with its activations in PyTorch's standard layout and
    channels-last, for every network at its config's cut (``--models``); see
    :mod:`benchmarks.trunk`.

``handoff``
    The trunk's step taken from one thread, alternating between two threads, and
    alternating with ``dataplane.trunk_sticky_core``; see :mod:`benchmarks.handoff`.

``parser``
    The worst frames a device can send (repeated entries, unknown fields, merged
    messages, nested groups) and an honest batch, decoded as the trunk decodes every
    request, at sizes up to the 64 MiB frame limit; see :mod:`benchmarks.parser`.

``allocator``
    Page faults per trunk step with glibc's malloc as set by default and as the
    trunk sets it (``dataplane.trunk_reuses_memory``); see :mod:`benchmarks.allocator`.

``gateway``
    The phone gateway's cost to its host per joined phone (its SuperNode, idle between
    rounds) for ``--clients`` phones (1 8 32 64 128), and per training phone in a round
    (its ClientApp, with ``--training`` Chromium pages, 4); see :mod:`benchmarks.gateway`.

``web-step``
    The web runtime's device step in headless Chromium on each TensorFlow.js backend
    that starts (``cpu``, ``wasm``, ``webgl``, ``webgpu``) against eager PyTorch on one thread, for
    every model and cut it trains (``--models cnn lenet5 resnet``); see
    :mod:`benchmarks.web_step`.

``gpu``
    The prepared accelerator check, one command of about 7 minutes on one GPU: the CUDA
    tests, the default job with the trunk on the device, ResNet-18 SplitFed v2 at 16 and 64
    devices against central training on the device (``--floor``: the accuracy below which
    a run is reported as not learning), and the trunk alone serving 1 to 1,024 synthetic
    devices (``--cut``, ``--client-processes``); ``--device cpu --quick`` rehearses it;
    see :mod:`benchmarks.gpu`.

Extra arguments are Hydra overrides, e.g. ``strategy.num_rounds=5``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import torch  # noqa: E402

from protocols import compose_config  # noqa: E402

#: The planners ``planner --methods`` may pick (the uniform cuts always run).
PLANNER_METHODS = ("greedy", "dynsl", "smartsplit", "smartsplit-random")


def bench_overhead_suite(overrides: Sequence[str], *, clients: Sequence[int],
                         workers: Sequence[int], floor: float = 0.5) -> None:
    """SplitFed through the real stack vs central training (:mod:`benchmarks.overhead`)."""
    from benchmarks.overhead import bench_overhead

    bench_overhead(overrides, clients=clients, workers=workers, floor=floor)


def bench_scale_suite(overrides: Sequence[str], *, clients: Sequence[int]) -> None:
    """Time per sample and memory by registered clients (:mod:`benchmarks.scale`)."""
    from benchmarks.scale import bench_scale

    bench_scale(overrides, registered=clients)


CLOCK_DEFAULTS = (
    "+scenario=heterogeneous",
    "devices.emulate=true",
    "strategy.num_rounds=2",
    "logger=none",
)


def bench_clock(overrides: Sequence[str]) -> float:
    """Emulated devices' wall time per round against the virtual clock; return the median error.

    With ``devices.emulate=true`` every client really waits as long as its device
    would (compute rescaled, bytes over its links, a round trip per exchange,
    its weights down and up). Per client, its wall time from receiving its
    weights to sending them back, less the time it waited for the trunk (the
    trunk's time, which the clock charges per round), is compared with the
    ``virtual-s`` the clock predicts; per round, the server's wall time from
    sending the round to having every reply with ``virtual_round_s``.
    Client-rounds where this host computed slower than the device would have
    (emulation can only slow a device down) are reported apart.
    """
    import csv
    import statistics

    from experiments.local import run_local

    cfg = compose_config([*CLOCK_DEFAULTS, *overrides])
    torch.set_num_threads(cfg.engine.torch_threads)
    with tempfile.TemporaryDirectory(prefix="bench-clock-") as run_dir:
        cfg.run_dir = run_dir
        # Every client at once, as real devices train: emulated devices mostly sleep.
        history = run_local(cfg, concurrency=cfg.num_clients).history
        with open(Path(run_dir) / "clients.csv") as f:
            rows = [r for r in csv.DictReader(f) if r["status"] in ("ok", "straggler")]
    for r in history[1:]:
        error = r["round_train_s"] / r["virtual_round_s"] - 1
        print(f"round {r['round']}: server wall {r['round_train_s']:.2f} s, clock "
              f"{r['virtual_round_s']:.2f} s ({error:+.1%})")
    # Emulation can slow a device down to its profile, never speed it up: where this host
    # computed slower than the device would (a Jetson against one contended core), the wall
    # time measures the host, not the clock. Those client-rounds are reported apart.
    errors: dict[str, list[float]] = {}
    too_fast: dict[str, list[float]] = {}
    for row in rows:
        virtual, wall = float(row["virtual_s"]), float(row["device_wall_s"])
        host_slower = float(row["compute_s"]) > float(row["virtual_compute_s"])
        (too_fast if host_slower else errors).setdefault(row["profile"], []).append(
            (wall - virtual) / virtual)
    for label, table in (("emulated", errors), ("faster than this host", too_fast)):
        for profile, errs in sorted(table.items()):
            print(f"{profile:>16} ({label}): {len(errs)} client-rounds, wall vs clock error "
                  f"median {statistics.median(errs):+.1%}, worst {max(errs, key=abs):+.1%}")
    everyone = [abs(e) for errs in errors.values() for e in errs]
    beyond = [abs(e) for errs in too_fast.values() for e in errs]
    median = statistics.median(everyone)
    print(f"emulated: median |error| {median:.1%}, p90 "
          f"{statistics.quantiles(everyone, n=10)[-1]:.1%}, max {max(everyone):.1%}; "
          f"{len(beyond)} client-rounds on devices faster than this host left out")
    print(json.dumps({"median_abs_error": median, "max_abs_error": max(everyone),
                      "client_rounds": len(everyone), "faster_than_host": len(beyond),
                      "median_abs_error_all": statistics.median(everyone + beyond)}))
    return median


def bench_memory(overrides: Sequence[str]) -> float:
    """Measured client memory at each cut vs training the whole model; return the best ratio.

    ResNet-18 at 32x32 (CIFAR-shaped, 10 classes), batch 32 by default; the
    client side with activation recomputation (its last stage plain), measured by
    :class:`clients.memory.MemoryMeter` on one SGD step with momentum.
    """
    from clients.memory import memory_saving_ratio
    from splitlearn.config import to_object
    from splitlearn.models.factory import build_model_from_config

    cfg = compose_config(["model=resnet18", "dataset=cifar10", *overrides])
    model = build_model_from_config(to_object(cfg.model), to_object(cfg.dataset), seed=0)
    batch = cfg.strategy.batch_size
    print(f"model={cfg.model.name} input={model.input_shape} batch={batch}")
    ratios = {}
    for cut in model.valid_cuts:
        row = memory_saving_ratio(model, cut, batch_size=batch)
        ratios[cut] = row["ratio"]
        print(f"cut {cut}: whole model {row['whole_bytes'] / 2**20:7.1f} MiB, client "
              f"recomputed {row['client_bytes'] / 2**20:6.1f} MiB ({row['ratio']:5.1f}x), "
              f"plain {row['client_plain_bytes'] / 2**20:6.1f} MiB ({row['plain_ratio']:5.1f}x)",
              flush=True)
    best = max(ratios, key=ratios.get)  # type: ignore[arg-type]
    print(json.dumps({"best_cut": best, "best_ratio": ratios[best], "ratios": ratios}))
    return ratios[best]


#: Payloads of the TLS benchmark: (label, overrides); the client side is stage 0 (cut 1).
TLS_PAYLOADS = (
    ("cnn 8x8, batch 32", ("model=cnn",)),
    ("resnet 32x32, batch 32", ("model=resnet", "dataset.image_size=32")),
    ("resnet 32x32, batch 128", ("model=resnet", "dataset.image_size=32",
                                 "strategy.batch_size=128")),
)


def bench_tls(overrides: Sequence[str], *, batches: int = 200) -> float:
    """Per-batch round trip over the data plane on loopback, plaintext vs TLS; worst ratio.

    For each payload a trunk service is started twice, plaintext and with TLS
    (a test CA from :mod:`experiments.certificates`), and one client sends
    ``batches`` forward requests to each, interleaved in blocks of 10, through
    the shipped channel (``TrunkChannel`` over ``GrpcTransport``). The time per
    batch includes the trunk's step; the median is reported.
    """
    import statistics

    from experiments.certificates import make_certificates
    from server.app import build_trunk
    from server.workers import server_credentials
    from splitlearn.config import to_object
    from splitlearn.dataplane import GrpcTransport, TrunkChannel, TrunkService
    from splitlearn.stages import split

    torch.set_num_threads(1)
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        files = make_certificates(Path(tmp))
        tls = [f"dataplane.ssl_certfile={files.certificate}",
               f"dataplane.ssl_keyfile={files.key}"]
        for label, payload in TLS_PAYLOADS:
            times: dict[str, list[float]] = {"plain": [], "tls": []}
            channels = {}
            services = []
            for mode, extra in (("plain", []), ("tls", tls)):
                cfg = compose_config([*payload, *extra, *overrides])
                trunk, _, tokens, endpoint = build_trunk(cfg)
                credentials = server_credentials(to_object(cfg.dataplane))
                service = TrunkService(endpoint, server_credentials=credentials)
                service.start()
                services.append(service)
                token = tokens.issue(client="bench", protocol=cfg.strategy.name, cut=1,
                                     server_round=1, ttl_s=3600)
                roots = files.ca.read_bytes() if mode == "tls" else None
                channels[mode] = TrunkChannel(GrpcTransport(service.address, token,
                                                            root_certificates=roots))
            batch = cfg.strategy.batch_size
            x = torch.rand(batch, *trunk.model.input_shape)
            y = torch.randint(0, trunk.num_classes, (batch,))
            acts = split(trunk.model, 1)[0](x).detach()
            for mode in channels:  # warm-up: connection, handshake, first step
                channels[mode].forward(acts, y)
            for _ in range(batches // 10):
                for mode, channel in channels.items():
                    for _ in range(10):
                        started = time.perf_counter()
                        channel.forward(acts, y)
                        times[mode].append(time.perf_counter() - started)
            for channel in channels.values():
                channel.close()
            for service in services:
                service.stop(0)
            plain, secure = (statistics.median(times[m]) * 1e3 for m in ("plain", "tls"))
            worst = max(worst, secure / plain)
            print(f"{label}: {acts.numel() * 4 / 2**20:.2f} MiB up per batch; plaintext "
                  f"{plain:.2f} ms, TLS {secure:.2f} ms per batch ({secure / plain:.2f}x)",
                  flush=True)
    print(json.dumps({"worst_tls_over_plaintext": worst}))
    return worst


def median_ms(run, *, steps: int) -> float:  # noqa: ANN001 - a callable of no arguments
    """Median wall time of ``run()`` over ``steps`` calls, after one warm-up, in ms."""
    import statistics

    run()
    samples = []
    for _ in range(steps):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e3


def executorch_step_times(name: str, overrides: Sequence[str], *, steps: int
                          ) -> tuple[float, float, int]:
    """Eager and ExecuTorch ms per client step of ``model=name`` at cut 1; the batch size."""
    from clients.executorch_program import ExecuTorchClientStep, export_client_step
    from splitlearn.config import to_object
    from splitlearn.models.factory import build_model_from_config
    from splitlearn.stages import split

    cfg = compose_config([f"model={name}", *overrides])
    model = build_model_from_config(to_object(cfg.model), to_object(cfg.dataset), seed=0)
    batch, lr = cfg.strategy.batch_size, cfg.strategy.lr
    x = torch.rand(batch, *model.input_shape)
    grad = torch.randn(batch, *model.cut_shape(1))
    bottom, _ = split(model, 1)
    optimizer = torch.optim.SGD(bottom.parameters(), lr=lr)
    device = ExecuTorchClientStep(export_client_step(model, 1, batch_size=batch), lr=lr)

    def eager_step() -> None:
        optimizer.zero_grad()
        bottom(x).backward(grad)
        optimizer.step()

    def executorch_step() -> None:
        device.activations(x)
        device.train(x, grad)

    return median_ms(eager_step, steps=steps), median_ms(executorch_step, steps=steps), batch


def bench_executorch(overrides: Sequence[str], *, steps: int = 50) -> float:
    """Client step time: the ExecuTorch program vs eager PyTorch; return the worst ratio.

    The client side at cut 1 (digits 8x8, batch 32; ``cnn`` and ``lenet5``, whose bottom
    ends in MaxPool2d), the trunk's gradient stood in by a fixed random tensor: eager is
    forward, backward from that gradient and an SGD step; ExecuTorch is the program's two
    runs (activations, then forward-backward) and its SGD step. Median of ``steps``.
    """
    torch.set_num_threads(1)
    worst = 0.0
    for name in ("cnn", "lenet5"):
        eager, executorch, batch = executorch_step_times(name, overrides, steps=steps)
        worst = max(worst, executorch / eager)
        print(f"{name} cut 1, batch {batch}: eager {eager:.3f} ms, ExecuTorch "
              f"{executorch:.3f} ms per step ({executorch / eager:.2f}x)", flush=True)
    print(json.dumps({"worst_executorch_over_eager": worst}))
    return worst


def bench_planner_suite(overrides: Sequence[str], *, seeds: int, target: float,
                        scenarios: Sequence[str] | None = None,
                        methods: Sequence[str] | None = None, first_seed: int = 0,
                        oracle_clients: int | None = None) -> None:
    """Uniform cuts vs planners on the virtual clock (:mod:`benchmarks.planner`)."""
    from benchmarks.planner import bench_planner

    bench_planner(overrides, seeds=seeds, target=target, scenarios=scenarios, methods=methods,
                  first_seed=first_seed, oracle_clients=oracle_clients)


def bench_rounds_suite(overrides: Sequence[str], *, repeats: int = 3,
                       floor: float = 0.5) -> None:
    """Time the default job's rounds and their budget (:mod:`benchmarks.rounds`)."""
    from benchmarks.rounds import bench_rounds

    bench_rounds(overrides, repeats=repeats, floor=floor)


def bench_compression_suite(overrides: Sequence[str], *, seeds: int = 3,
                            methods: Sequence[str] | None = None) -> None:
    """Bytes saved vs accuracy lost per method (:mod:`benchmarks.compression`)."""
    from benchmarks.compression import OPTIONS, bench_compression

    bench_compression(overrides, seeds=seeds, methods=methods or OPTIONS)


def bench_latency_suite(overrides: Sequence[str]) -> None:
    """Time the data plane against raw gRPC (:mod:`benchmarks.latency`)."""
    from benchmarks.latency import bench_latency

    bench_latency(overrides)


def bench_communication_suite(overrides: Sequence[str]) -> None:
    """Protocols' bytes per sample vs FedAvg (:mod:`benchmarks.communication`)."""
    from benchmarks.communication import bench_communication

    bench_communication(overrides)


def bench_defences_suite(overrides: Sequence[str], *, repeats: int = 3) -> None:
    """Honest runs with the trunk's defences on and off (:mod:`benchmarks.defences`)."""
    from benchmarks.defences import bench_defences

    bench_defences(overrides, repeats=repeats)


def bench_executorch_rounds_suite(overrides: Sequence[str]) -> None:
    """Time ClientApp rounds in ExecuTorch vs eager (:mod:`benchmarks.executorch_rounds`)."""
    from benchmarks.executorch_rounds import main as rounds

    rounds(overrides)


def bench_netns_suite(overrides: Sequence[str], *, relay: bool = True) -> None:
    """Time a SuperNode behind a shaped link vs the clock (:mod:`benchmarks.netns`).

    ``relay=False`` leaves the latency out (the veth's own).
    """
    from benchmarks.netns import run_bench

    run_bench(overrides, relay=relay)


def bench_trunk_suite(overrides: Sequence[str], *, models: Sequence[str] | None = None
                      ) -> None:
    """Time the trunk's step per activation layout (:mod:`benchmarks.trunk`)."""
    from benchmarks.trunk import bench_trunk

    bench_trunk(overrides, models=models)


def bench_handoff_suite(overrides: Sequence[str]) -> None:
    """Time the trunk's step as it hops threads (:mod:`benchmarks.handoff`)."""
    from benchmarks.handoff import bench_handoff

    bench_handoff(overrides)


def bench_parser_suite(overrides: Sequence[str]) -> None:
    """Time the decoder on the worst frames (:mod:`benchmarks.parser`)."""
    from benchmarks.parser import bench_parser

    bench_parser(overrides)


def bench_allocator_suite(overrides: Sequence[str]) -> None:
    """Count the trunk step's page faults per allocator setting (:mod:`benchmarks.allocator`)."""
    from benchmarks.allocator import bench_allocator

    bench_allocator(overrides)


def bench_gateway_suite(overrides: Sequence[str], *, phones: Sequence[int],
                        training: int) -> None:
    """Measure the phone gateway's cost per phone (:mod:`benchmarks.gateway`)."""
    from benchmarks.gateway import bench_gateway

    if overrides:
        raise SystemExit("gateway takes no overrides: its round is the default job")
    bench_gateway(phones, training=training, idle_s=20.0)


def bench_gpu_suite(overrides: Sequence[str], *, device: str, quick: bool,
                    parts: Sequence[str] | None, floor: float, cut: int,
                    client_processes: int | None) -> None:
    """Run the prepared accelerator check (:mod:`benchmarks.gpu`)."""
    from benchmarks.gpu import PARTS, bench_gpu

    bench_gpu(overrides, device=device, quick=quick, parts=parts or PARTS, floor=floor,
              cut=cut, client_processes=client_processes)


def bench_web_step_suite(overrides: Sequence[str], *, models: Sequence[str] | None) -> None:
    """Time the web runtime's step against eager PyTorch (:mod:`benchmarks.web_step`)."""
    from benchmarks.web_step import MODELS, bench_web_step

    if overrides:
        raise SystemExit("web-step takes no overrides: it times the device step alone")
    bench_web_step(models or list(MODELS))


BENCHMARKS = {"overhead": bench_overhead_suite, "rounds": bench_rounds_suite,
              "defences": bench_defences_suite,
              "compression": bench_compression_suite, "communication": bench_communication_suite,
              "latency": bench_latency_suite, "scale": bench_scale_suite,
              "clock": bench_clock, "memory": bench_memory, "planner": bench_planner_suite,
              "tls": bench_tls, "executorch": bench_executorch,
              "executorch-rounds": bench_executorch_rounds_suite, "netns": bench_netns_suite,
              "trunk": bench_trunk_suite, "handoff": bench_handoff_suite,
              "allocator": bench_allocator_suite, "parser": bench_parser_suite,
              "gateway": bench_gateway_suite, "web-step": bench_web_step_suite,
              "gpu": bench_gpu_suite}


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Read the benchmark's name, its Hydra overrides and its options, in any order.

    Intermixed: ``rounds --repeats 1 dataplane.trunk_workers=2`` reads the override
    after an option too (plain ``parse_args`` refuses it as an unrecognised argument).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides")
    parser.add_argument("--seeds", type=int, default=3, help="planner, compression: seeds")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="planner: the first seed (seeds run from it on)")
    parser.add_argument("--oracle-clients", type=int,
                        help="planner: also DynSL against the clock's oracle on this many "
                        "devices (at most 6)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds, defences: runs of each job")
    parser.add_argument("--clients", type=int, nargs="+",
                        help="overhead: clients (1 4 16); scale: registered (10 ... 10000); "
                        "gateway: phones joined (1 8 32 64 128)")
    parser.add_argument("--training", type=int, default=4,
                        help="gateway: Chromium phones training one round (0: none)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="overhead: numbers of trunk workers")
    parser.add_argument("--target", type=float, default=0.9, help="planner: test accuracy")
    parser.add_argument("--scenarios", nargs="+",
                        choices=("heterogeneous", "dynamic", "wide_spread"),
                        help="planner: only these scenarios")
    parser.add_argument("--methods", nargs="+",
                        help="planner: only these planners (the uniform cuts always run: "
                        f"{', '.join(PLANNER_METHODS)}); compression: only these options "
                        "(none among them)")
    parser.add_argument("--models", nargs="+", help="trunk, web-step: only these networks")
    parser.add_argument("--no-relay", action="store_true",
                        help="netns: no latency relay (the veth's own RTT)")
    parser.add_argument("--device", default="cuda",
                        help="gpu: the device (a server.device value; cpu to rehearse)")
    parser.add_argument("--quick", action="store_true", help="gpu: small sizes (a rehearsal)")
    parser.add_argument("--parts", nargs="+", choices=("tests", "default", "resnet18", "serve"),
                        help="gpu: only these parts")
    parser.add_argument("--floor", type=float, default=0.5,
                        help="gpu, overhead, rounds: test accuracy below which a run is not "
                        "learning (it gets no throughput figure)")
    parser.add_argument("--cut", type=int, default=4, help="gpu: the serving trunk's cut")
    parser.add_argument("--client-processes", type=int,
                        help="gpu: processes the synthetic devices run in")
    args = parser.parse_intermixed_args(argv)
    accepted = {"planner": PLANNER_METHODS, "compression": compression_options()}
    if args.methods and args.name in accepted:
        unknown = sorted(set(args.methods) - set(accepted[args.name]))
        if unknown:
            parser.error(f"--methods {' '.join(unknown)}: {args.name} accepts "
                         f"{', '.join(accepted[args.name])}")
    return args


def compression_options() -> tuple[str, ...]:
    """Return the compression benchmark's options (imported only when asked for)."""
    from benchmarks.compression import OPTIONS

    return OPTIONS


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the benchmark name and its Hydra overrides; run it."""
    args = parse_arguments(argv)
    if args.name == "planner":
        bench_planner_suite(args.overrides, seeds=args.seeds, target=args.target,
                            scenarios=args.scenarios, methods=args.methods,
                            first_seed=args.first_seed, oracle_clients=args.oracle_clients)
    elif args.name == "compression":
        bench_compression_suite(args.overrides, seeds=args.seeds, methods=args.methods)
    elif args.name == "overhead":
        bench_overhead_suite(args.overrides, clients=args.clients or [1, 4, 16],
                             workers=args.workers, floor=args.floor)
    elif args.name == "scale":
        bench_scale_suite(args.overrides, clients=args.clients or [10, 100, 1000, 10000])
    elif args.name == "rounds":
        bench_rounds_suite(args.overrides, repeats=args.repeats, floor=args.floor)
    elif args.name == "defences":
        bench_defences_suite(args.overrides, repeats=args.repeats)
    elif args.name == "trunk":
        bench_trunk_suite(args.overrides, models=args.models)
    elif args.name == "web-step":
        bench_web_step_suite(args.overrides, models=args.models)
    elif args.name == "gateway":
        bench_gateway_suite(args.overrides, phones=args.clients or [1, 8, 32, 64, 128],
                            training=args.training)
    elif args.name == "netns":
        bench_netns_suite(args.overrides, relay=not args.no_relay)
    elif args.name == "gpu":
        bench_gpu_suite(args.overrides, device=args.device, quick=args.quick, parts=args.parts,
                        floor=args.floor, cut=args.cut, client_processes=args.client_processes)
    else:
        BENCHMARKS[args.name](args.overrides)


if __name__ == "__main__":
    main()
