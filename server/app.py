"""The Flower ServerApp: the trunk service in ``lifespan``, the protocol's strategy in ``main``.

Two ways in, one code path:

* ``experiments.run`` (Hydra) composes the config and calls
  :func:`build_server_app` with it, then runs Flower's Simulation Engine.
* ``flwr run .`` loads the module-level :data:`app`, which composes the config
  from the run config's ``overrides`` string (Hydra override syntax).

Either way the config is checked before anything starts (:func:`protocols.check_config`).
"""

from __future__ import annotations

import copy
import logging
import math
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from flwr.superlink.grid import InMemoryGrid
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from protocols import Protocol, check_config, compose_config, protocol_named, tail_cut_of
from server.checkpoint import (
    RunCheckpoint,
    load_checkpoint,
    random_states,
    restore_random_states,
    save_checkpoint,
)
from server.clock import device_rounds
from server.guard import reference_rows
from server.trunk import Trunk
from server.workers import (
    TrunkRecipe,
    TrunkWorkers,
    server_credentials,
    server_ssl_context,
    set_up_trunk_process,
)
from splitlearn.aux_head import without_aux
from splitlearn.calibration import cut_costs, measure_host_flops_per_s, measure_trunk_step_s
from splitlearn.config import (
    CompressionConfig,
    PlannerConfig,
    RunSpec,
    run_spec,
    to_container,
    to_object,
)
from splitlearn.data import held_out_dataset
from splitlearn.dataplane import (
    TokenRegistry,
    TrunkEndpoint,
    TrunkService,
    TrunkWebSocketService,
)
from splitlearn.dataplane.codec import decode_tensor, encoder
from splitlearn.evaluation import evaluate_model, intra_op_threads, usable_cores
from splitlearn.messages import UPDATE_WEIGHT_KEY, record_to_state, state_to_record
from splitlearn.models import SplittableModel
from splitlearn.models.factory import source_module
from splitlearn.planning.clock import VirtualClock
from splitlearn.planning.cost import CutCost, Plan, with_compression, with_kept_samples
from splitlearn.planning.devices import DeviceProfile, build_fleet
from splitlearn.planning.queue import (
    TrunkOf,
    dealt,
    own,
    round_seconds,
    sequential_round_seconds,
    shared,
)
from splitlearn.privacy import GaussianActivationMechanism, with_release_at_cut
from splitlearn.stages import load_bottom_state
from splitlearn.tracking import CompositeSink, make_sinks
from strategies.adaptive import CutPlanning, build_planner, prior_state
from strategies.key_exchange import NodeKeys
from strategies.privacy import ClippedUpdateNoise, PrivacyBudgetGuard
from strategies.reporting import RoundOutcome
from strategies.resume import ResumedRounds
from strategies.splitfed import DataPlaneAccess

log = logging.getLogger(__name__)


@dataclass
class SplitRuntime:
    """Everything that lives for one run on the server side."""

    cfg: DictConfig
    protocol: Protocol
    spec: RunSpec
    run_dir: Path
    trunk: Trunk
    trunk_side: Any  # the protocol's session handler; None without a data plane
    tokens: TokenRegistry
    endpoint: TrunkEndpoint
    service: TrunkService | None
    sinks: CompositeSink
    fleet: list[DeviceProfile] | None  # profile per partition id; None: no emulation
    planning: CutPlanning | None  # per-client cuts; None: every client at model.cut
    resumed: RunCheckpoint | None = None  # resume=true: the run's last checkpoint
    workers: TrunkWorkers | None = None  # dataplane.trunk_workers > 1: the trunk's processes
    websocket: TrunkWebSocketService | None = None  # dataplane.websocket_port: for browsers


def trunk_recipe(cfg: DictConfig) -> TrunkRecipe:
    """Return what builds the run's trunk (in this process, and in each trunk worker)."""
    dataplane = to_object(cfg.dataplane)
    if cfg.privacy.name == "activation_gaussian" and dataplane.guard.loss_factor:
        # Noised releases make an honest device's loss as large as its noise (and each
        # device class may have its own, privacy.per_device): a bound from the others'
        # losses refused honest devices (a loss of 50 at sigma 2 beside a median of 2.3).
        log.info("trunk guard: no loss check (dataplane.guard.loss_factor): devices release "
                 "noised activations (privacy=activation_gaussian)")
        dataplane = replace(dataplane, guard=replace(dataplane.guard, loss_factor=0.0))
    return TrunkRecipe(
        protocol=cfg.strategy.name, model=to_object(cfg.model), dataset=to_object(cfg.dataset),
        seed=cfg.seed, options=to_object(cfg.strategy), dataplane=dataplane,
        server=to_object(cfg.server),
    )


def build_trunk(cfg: DictConfig) -> tuple[Trunk, Any, TokenRegistry, TrunkEndpoint]:
    """Build the seeded model's trunk, the protocol's session handler and the endpoint."""
    return trunk_recipe(cfg).build()


def start_runtime(cfg: DictConfig) -> SplitRuntime:
    """Check the config, build the trunk, start the trunk service, open the sinks."""
    check_config(cfg)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Under `flwr run` a relative folder lands in the SuperLink's working folder: say where.
    log.info("run folder: %s", run_dir.resolve())
    resumed = load_checkpoint(run_dir, config=to_container(cfg)) if cfg.resume else None
    set_up_trunk_process(cfg.dataplane)
    protocol = protocol_named(cfg.strategy.name)
    trunk, handler, tokens, endpoint = build_trunk(cfg)
    service = workers = websocket = None
    if handler is not None and cfg.dataplane.trunk_workers > 1:
        workers = TrunkWorkers(trunk, tokens, trunk_recipe(cfg),
                               workers=cfg.dataplane.trunk_workers)
        handler = workers  # the strategy settles rounds with the workers, not a local handler
    elif handler is not None:
        service = TrunkService(
            endpoint, host=cfg.dataplane.host, port=cfg.dataplane.port,
            advertise_host=cfg.dataplane.advertise_host, max_streams=cfg.dataplane.max_streams,
            server_credentials=server_credentials(to_object(cfg.dataplane)),
        )
        service.start()
        if cfg.dataplane.websocket_port is not None:
            websocket = TrunkWebSocketService(
                endpoint, host=cfg.dataplane.host, port=cfg.dataplane.websocket_port,
                advertise_host=cfg.dataplane.advertise_host,
                max_streams=cfg.dataplane.max_streams,
                ssl_context=server_ssl_context(to_object(cfg.dataplane)),
            )
            websocket.start()
    sinks = make_sinks(
        run_dir=run_dir, logger=cfg.logger.name, project=cfg.logger.project,
        group=cfg.logger.group, tags=list(cfg.logger.tags), wandb_mode=cfg.logger.mode,
        wandb_resume_id=resumed.sinks.get("wandb_id") if resumed else None,
        plots=cfg.logger.plots,
    )
    devices = to_object(cfg.devices)
    fleet = build_fleet(
        num_clients=cfg.num_clients, mix=devices.mix, seed=cfg.seed,
        profiles={k: vars(v) for k, v in devices.profiles.items()},
    )
    if resumed is not None:  # the clock keeps converting compute as it did before the crash
        spec = run_spec(cfg, host_flops_per_s=resumed.measured["host_flops_per_s"])
        spec.devices.host_flops_by_cut = dict(resumed.measured["host_flops_by_cut"])
    else:
        # The devices' work is emulated on this host's CPU: measured on the model there.
        host = trunk.host_model()
        spec = run_spec(cfg, host_flops_per_s=host_flops_for(cfg, host) if fleet else 0.0)
        if fleet and cfg.planner.name != "uniform":
            spec.devices.host_flops_by_cut = host_flops_by_cut(cfg, host)
    config = to_container(cfg)
    config["devices"]["host_flops_per_s"] = spec.devices.host_flops_per_s  # as measured
    config["devices"]["host_flops_by_cut"] = dict(spec.devices.host_flops_by_cut)
    sinks.log_config(config)
    planning = make_planning(cfg, trunk, resuming=resumed is not None)
    return SplitRuntime(
        cfg, protocol, spec, run_dir, trunk, handler, tokens, endpoint, service, sinks, fleet,
        planning, resumed, workers, websocket,
    )


def make_planning(cfg: DictConfig, trunk: Trunk, *, resuming: bool = False
                  ) -> CutPlanning | None:
    """Build the planner's server side for an adaptive ``planner``, with the cut table.

    The trunk's step is timed at every cut, unless the run is ``resuming``: its checkpoint
    holds the steps timed when it started (:meth:`CutPlanning.restore` puts them back).
    """
    settings: PlannerConfig = to_object(cfg.planner)
    if not settings.adaptive:
        return None
    allowed = set(settings.cuts or trunk.model.valid_cuts)
    leak = {int(k): float(v) for k, v in settings.leak.items()}
    step = protocol_named(cfg.strategy.name).client
    # The step says how it talks to the trunk: round trips per batch, whether a gradient
    # comes back (local loss only sends) and what it keeps of what it sent ...
    encoding: CompressionConfig = to_object(cfg.dataplane.compression)
    kept = step.kept_samples_cap(to_object(cfg.strategy), encoding)
    tail_cut = tail_cut_of(cfg.strategy, trunk.model)
    features = 0 if tail_cut is None else math.prod(trunk.model.cut_shape(tail_cut))

    def as_the_run_sends(cost: CutCost) -> CutCost:
        """... and with the tensors at the cut as the data plane encodes them."""
        cost = with_kept_samples(replace(cost, exchanges_per_batch=step.exchanges_per_batch,
                                         returns_gradient=step.receives_gradient), kept)
        return with_compression(cost, uplink=encoding.uplink, downlink=encoding.downlink,
                                topk_fraction=encoding.topk_fraction,
                                error_feedback=encoding.error_feedback, feature_entries=features)

    costs = [as_the_run_sends(c)
             for c in cut_costs(trunk.host_model(), batch_size=cfg.strategy.batch_size, leak=leak,
                                tail_cut=tail_cut, frees_output=step.frees_sent_output)
             if c.cut in allowed]
    shared = protocol_named(cfg.strategy.name).capabilities.trunk == "shared"
    planner = build_planner(settings, costs, shared_trunk=shared,
                            seed=cfg.seed)
    return CutPlanning(
        planner=planner, costs=costs, trunk_busy_s=lambda: trunk.busy_s,
        prior=prior_state(settings, batch_size=cfg.strategy.batch_size,
                          epochs=cfg.strategy.local_epochs),
        smoothing=settings.smoothing, trunk_of=trunk_of_run(cfg),
        # The trunk's step at every cut, measured here: the shape of its cost over cuts
        # until the rounds measure it in place.
        trunk_steps=[] if resuming else [
            (1.0, cfg.strategy.batch_size * c.server_flops_per_sample,
             measure_trunk_step_s(trunk.model, c.cut, end=tail_cut,
                                  batch_size=cfg.strategy.batch_size,
                                  threads=cfg.engine.torch_threads,
                                  precision=trunk.precision))
            for c in costs],
    )


def host_flops_for(cfg: DictConfig, model: SplittableModel) -> float:
    """Return the configured host FLOP/s, or measure it on the client-side workload."""
    if cfg.devices.host_flops_per_s:
        return float(cfg.devices.host_flops_per_s)
    flops = measure_host_flops_per_s(
        model, cfg.model.cut, batch_size=cfg.strategy.batch_size,
        threads=cfg.engine.torch_threads,
    )
    log.info("virtual clock: this host trains at %.2f GFLOP/s", flops / 1e9)
    return flops


def host_flops_by_cut(cfg: DictConfig, model: SplittableModel) -> dict[int, float]:
    """Return the configured per-cut FLOP/s, or measure each cut (none if one figure is set)."""
    if cfg.devices.host_flops_by_cut or cfg.devices.host_flops_per_s:
        return {int(k): float(v) for k, v in cfg.devices.host_flops_by_cut.items()}
    measured = {
        cut: measure_host_flops_per_s(model, cut, batch_size=cfg.strategy.batch_size,
                                      threads=cfg.engine.torch_threads)
        for cut in cfg.planner.cuts or model.valid_cuts
    }
    log.info("virtual clock: this host trains at %s GFLOP/s by cut",
             {c: round(f / 1e9, 2) for c, f in measured.items()})
    return measured


def stop_runtime(runtime: SplitRuntime) -> None:
    """Stop the trunk service and close the sinks (writes plots)."""
    if runtime.service is not None:
        runtime.service.stop()
    if runtime.websocket is not None:
        runtime.websocket.stop()
    if runtime.workers is not None:
        runtime.workers.stop()
    runtime.sinks.close()


def make_strategy(runtime: SplitRuntime, reporter: RoundReporter) -> Strategy:
    """Build the protocol's strategy, wrapped by DP-FedAvg and the privacy budget guard if on."""
    cfg, protocol = runtime.cfg, runtime.protocol
    s = cfg.strategy
    kwargs: dict[str, Any] = {
        "protocol": protocol.name,
        "spec": runtime.spec,
        "on_round": reporter.record_round,
        "round_deadline_s": cfg.failures.round_deadline_s,
        "fraction_train": s.fraction_train,
        "fraction_evaluate": s.fraction_evaluate,
        "min_train_nodes": s.min_train_nodes,
        "min_evaluate_nodes": s.min_train_nodes if s.fraction_evaluate > 0 else 0,
        "min_available_nodes": s.min_train_nodes,
    }
    if runtime.trunk_side is not None:
        kwargs |= {"dataplane": dataplane_access(runtime), "trunk": runtime.trunk_side,
                   "set_trunk_lr_factor": (runtime.workers or runtime.trunk).set_lr_factor}
    if runtime.planning is not None:
        kwargs["planning"] = runtime.planning
    aggregation = to_object(cfg.aggregation)
    kwargs["aggregation"] = aggregation  # the bound on claimed examples, a robust rule
    if aggregation.secure:
        kwargs["secure_aggregation"] = aggregation
    if aggregation.clipped:  # DP-FedAvg: every device counts the same in the average
        kwargs["weighted_by_key"] = UPDATE_WEIGHT_KEY
    strategy = protocol.strategy(**kwargs)
    # Privacy wraps the protocol, as Flower's DP wrappers do.
    if aggregation.clipped:
        strategy = ClippedUpdateNoise(
            strategy, noise_multiplier=aggregation.update_noise_multiplier,
            clipping_norm=aggregation.update_clip_norm, delta=aggregation.update_delta)
    return PrivacyBudgetGuard(strategy) if runtime.spec.privacy.accounted else strategy


def dataplane_access(runtime: SplitRuntime) -> DataPlaneAccess:
    """How the strategy grants sessions: on the trunk service, or dealt to the trunk workers."""
    cfg = runtime.cfg
    ttl_s = cfg.dataplane.token_ttl_s
    keys = NodeKeys(timeout_s=cfg.strategy.round_timeout_s) if cfg.dataplane.node_keys else None
    if runtime.workers is not None:
        return DataPlaneAccess(runtime.tokens, runtime.workers.addresses[0], ttl_s,
                               route=runtime.workers.route, node_keys=keys)
    assert runtime.service is not None
    websocket = runtime.websocket.url if runtime.websocket is not None else None
    return DataPlaneAccess(runtime.tokens, runtime.service.address, ttl_s, node_keys=keys,
                           websocket=websocket)


def initial_arrays(runtime: SplitRuntime) -> ArrayRecord:
    """Return what the clients hold at round 1 (the protocol's client step says which stages)."""
    planning = runtime.planning
    cuts = sorted(planning.costs) if planning is not None else [runtime.spec.model.cut]
    state = runtime.protocol.client.initial_state(runtime.trunk.host_model(), runtime.spec,
                                                  cuts=cuts)
    return state_to_record(state)


def joined_model(runtime: SplitRuntime, arrays: ArrayRecord) -> SplittableModel:
    """Join the current trunk and the aggregated client side (aux heads left out)."""
    model = runtime.trunk.snapshot()
    load_bottom_state(model, without_aux(record_to_state(arrays)))
    return model


def memory_usage(rows: list[dict[str, Any]]) -> float:
    """Return the largest share of its budget a client's measured training peak took (0: none)."""
    shares = [float(r["peak_memory_bytes"]) / float(r["memory_budget"]) for r in rows
              if r["status"] == "ok" and float(r.get("memory_budget", 0) or 0) > 0
              and "peak_memory_bytes" in r]
    return max(shares, default=0.0)


#: Held-out examples whose rows calibrate the trunk's guard each round.
REFERENCE_ROWS = 256


def trunk_of_run(cfg: DictConfig) -> TrunkOf:
    """Return which trunk serves each device in this run (the clock's queues)."""
    if protocol_named(cfg.strategy.name).capabilities.trunk == "per_device":
        return own
    workers = cfg.dataplane.trunk_workers
    return dealt(workers) if workers > 1 else shared


def planned_vs_clock(plan: Plan, clock: dict[str, float], finished_s: float | None
                     ) -> dict[str, float]:
    """Return the plan's predicted round beside what the clock charged (``clock``'s keys).

    ``planned_round_s`` is the round predicted as the clock charges it (played out at the
    trunk), ``planned_makespan_s`` the planner's objective (the slowest client's own round
    plus all trunk work, an upper bound) with its parts. ``finished_s`` is the same
    prediction for the devices that finished (the clock plays out only those), and
    ``plan_error`` = ``finished_s`` / charged - 1 (0.1: the plan said 10% longer).
    """
    predicted = plan.makespan_s if plan.round_s is None else plan.round_s
    planned = {"planned_round_s": predicted, "planned_makespan_s": plan.makespan_s,
               "planned_slowest_client_s": plan.slowest_client_s,
               "planned_trunk_s": plan.trunk_s}
    if finished_s is not None:
        planned["planned_finished_round_s"] = finished_s
        if clock.get("virtual_round_s", 0.0) > 0 and finished_s > 0:
            planned["plan_error"] = finished_s / clock["virtual_round_s"] - 1.0
    return planned


class RoundReporter:
    """Reports each round: the strategy's ``on_round`` outcome, then Flower's ``evaluate_fn``.

    Called by ``Strategy.start`` before round 1 (round 0) and after each round, it
    evaluates the aggregated client side joined with the current trunk on the
    held-out test split, merges the round's outcome, advances the virtual clock
    (the finished devices' rounds played out at the trunk: :mod:`server.clock`), writes
    everything to every sink and updates the progress bar.
    """

    def __init__(self, runtime: SplitRuntime) -> None:
        self.runtime = runtime
        cfg = runtime.cfg
        self.test_loader = DataLoader(held_out_dataset(runtime.spec.dataset, seed=cfg.seed),
                                      batch_size=512)
        self.started = time.perf_counter()
        self.history: list[dict[str, float]] = []
        self.clock = VirtualClock()
        self.epsilon = 0.0
        self._outcomes: dict[int, RoundOutcome] = {}
        self._round_ends: list[float] = []
        self._trunk_busy_seen = 0.0
        self._trunk_of = trunk_of_run(cfg)
        # Devices wait for the trunk's answer to each batch, except those that only send.
        self._waits = protocol_named(cfg.strategy.name).client.exchanges_per_batch > 0
        planning = runtime.planning
        self._trunk_flops = ({c: cost.server_flops_per_sample for c, cost in planning.costs.items()}
                             if planning is not None else None)
        #: Called with (round, arrays) once a round is recorded (the run's checkpoint).
        self.after_round: Callable[[int, ArrayRecord], None] | None = None
        self.progress = tqdm(total=cfg.strategy.num_rounds, unit="round", desc="training",
                             dynamic_ncols=True, file=sys.stderr)

    def checkpoint(self) -> dict[str, Any]:
        """Return the clock, the history and the elapsed time (a resumed run continues them)."""
        return {"clock_s": self.clock.now_s, "history": [dict(r) for r in self.history],
                "epsilon": self.epsilon, "trunk_busy_seen": self._trunk_busy_seen,
                "wall_s": time.perf_counter() - self.started,
                "round_ends": list(self._round_ends)}

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue from :meth:`checkpoint`'s state."""
        self.clock.now_s = saved["clock_s"]
        self.history = [dict(r) for r in saved["history"]]
        self.epsilon = saved["epsilon"]
        self._trunk_busy_seen = saved["trunk_busy_seen"]
        self.started = time.perf_counter() - saved["wall_s"]
        self._round_ends = list(saved["round_ends"])
        self.progress.update(len(self.history) - 1)  # rounds done (the history has round 0)

    def record_round(self, outcome: RoundOutcome) -> None:
        """Keep a round's outcome (the strategy's ``on_round`` hook) until its evaluation."""
        self._outcomes[outcome.server_round] = outcome

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Evaluate and log ``server_round``; return the test metrics."""
        joined = joined_model(self.runtime, arrays)
        deployed = with_release_at_cut(  # the trunk only ever sees released rows
            joined, cut=self.runtime.spec.model.cut, settings=self.runtime.spec.privacy,
        )
        evaluating = time.perf_counter()
        loss, accuracy = self._evaluate(deployed)
        self._seed_guard(joined, deployed)
        evaluate_s = time.perf_counter() - evaluating
        metrics: dict[str, float] = {}
        outcome = self._outcomes.pop(server_round, None)
        rows = [self._with_profile(r) for r in outcome.rows] if outcome else []
        if outcome is not None:
            metrics |= outcome.metrics
            metrics["examples"] = metrics.pop("num_examples", 0.0)
        # The run's own figures last: no client metric of the same name may replace them.
        metrics |= {"test_accuracy": accuracy, "test_loss": loss, "evaluate_s": evaluate_s,
                    "wall_s": time.perf_counter() - self.started}
        metrics |= self._advance_clock(outcome, rows)
        metrics |= self._guard_books()  # refused frames, clipped steps, quarantined devices
        if usage := memory_usage(rows):
            metrics["memory_over_budget"] = usage  # measured peak / budget, worst client
        planning = self.runtime.planning
        if planning is not None and (plan := planning.plans.get(server_round)) is not None:
            finished = {str(r["node_id"]) for r in rows if r["status"] == "ok"}
            metrics |= planned_vs_clock(plan, metrics, planning.predicted_round_s(
                server_round, finished))
        if self.runtime.spec.privacy.accounted:
            reported = [float(r["epsilon"]) for r in rows if "epsilon" in r]
            self.epsilon = max([self.epsilon, *reported])  # the worst-off client, monotone
            metrics["epsilon"] = self.epsilon
        self.history.append({"round": server_round, **metrics})
        self.runtime.sinks.log_round(server_round, metrics)
        if rows:
            self.runtime.sinks.log_clients(server_round, rows)
        self._print_progress(server_round, metrics)
        if server_round and self.after_round is not None:
            self.after_round(server_round, arrays)
        return MetricRecord({"test-accuracy": accuracy, "test-loss": loss})

    def _seed_guard(self, joined: SplittableModel, deployed: nn.Module) -> None:
        """Calibrate the trunk's guard, and every trunk worker's, on this round's reference.

        The bounds then hold from a round's first frame, with no warm-up an attacker could
        use, wherever the trunk runs: a worker's guard would otherwise calibrate from the
        rows its devices send first.
        """
        guard = self.runtime.trunk.guard
        if guard is None:
            return
        rows = self._reference_rows(joined, deployed)
        guard.seed_all(rows)
        if self.runtime.workers is not None:
            self.runtime.workers.seed_guards(rows)

    def _reference_rows(self, joined: SplittableModel, deployed: nn.Module
                        ) -> dict[tuple[str, int], torch.Tensor]:
        """Return what honest devices send this round, by (kind, cut) (:func:`reference_rows`).

        The rows the round's model gives the server's own held-out examples at every cut
        in play (and a device tail's gradient), released or noised as devices send them:
        no device can bias them.
        """
        planning, spec = self.runtime.planning, self.runtime.spec
        inputs, labels = next(iter(self.test_loader))
        count = min(len(inputs), REFERENCE_ROWS)
        received, returned = self._as_devices_exchange()
        rows = reference_rows(
            joined, inputs[:count], labels[:count],
            cuts=sorted(planning.costs) if planning is not None else [spec.model.cut],
            tail_cut=tail_cut_of(spec.strategy, joined), batch_size=spec.strategy.batch_size,
            received=received, returned=returned)
        if deployed is not joined:  # activations leave a device released at its cut
            release = deployed[spec.model.cut]  # type: ignore[index]
            with torch.no_grad():
                rows |= {key: release(value) for key, value in rows.items()
                         if key[0] == "activations"}
        return rows

    def _as_devices_exchange(self) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                            Callable[[torch.Tensor], torch.Tensor]]:
        """Return what a U-shaped device receives of features and what it returns of a gradient.

        The features as the downlink's compression leaves them; the gradient noised as the
        device's privacy options ask (each row scaled to one example's first, as devices
        do), then as the uplink's compression leaves it.
        """
        spec = self.runtime.spec
        down = encoder(spec.compression, "downlink")
        up = encoder(spec.compression, "uplink")
        limit = spec.max_frame_bytes
        noise = GaussianActivationMechanism(
            clip_norm=spec.privacy.gradient_clip_norm,
            noise_multiplier=spec.privacy.gradient_noise_multiplier,
        ) if spec.privacy.gradient_noise_multiplier else None

        def received(features: torch.Tensor) -> torch.Tensor:
            return decode_tensor(down(features), name="features", max_bytes=limit)

        def returned(grad: torch.Tensor) -> torch.Tensor:
            if noise is not None:
                with torch.no_grad():
                    grad = noise(grad * len(grad)) / len(grad)
            return decode_tensor(up(grad), name="grad", max_bytes=limit)

        return received, returned

    def _guard_books(self) -> dict[str, int]:
        """Return the round's guard counts: the trunk's and every trunk worker's, added up.

        A device dealt to a worker is refused and quarantined by that worker's guard; its
        ``clients.csv`` row says so as a local one's does (its reply carries the refusal).
        """
        guard = self.runtime.trunk.guard
        if guard is None:
            return {}
        books = Counter(guard.take_books())
        if self.runtime.workers is not None:
            books.update(self.runtime.workers.take_guard_books())
        return dict(books)

    def _evaluate(self, deployed: nn.Module) -> tuple[float, float]:
        # In the trunk's layout (1.6x faster for the SmallCNN alone; `deployed` is the
        # reporter's own copy), and on every core: between rounds the trunk is idle.
        # On the trunk's device: a copy there, as the guard's reference reads this one.
        channels_last, device = self.runtime.trunk.channels_last, self.runtime.trunk.device
        if device.type != "cpu":
            deployed = copy.deepcopy(deployed)
        if channels_last:
            deployed = deployed.to(memory_format=torch.channels_last)
        with intra_op_threads(usable_cores()):
            loss, accuracy, _ = evaluate_model(deployed, self.test_loader,
                                               channels_last=channels_last, device=device)
        return loss, accuracy

    def _with_profile(self, row: dict[str, Any]) -> dict[str, Any]:
        if row.get("profile"):  # a real device's declared preset (strategies.reporting)
            return row
        fleet = self.runtime.fleet
        if fleet is None:
            return row | {"profile": "host"}
        # Failed clients reply with an error, which carries no partition id.
        partition = row.get("partition_id")
        return row | {"profile": fleet[partition].name if partition is not None else "?"}

    def _advance_clock(self, outcome: RoundOutcome | None, rows: list[dict[str, Any]]
                       ) -> dict[str, float]:
        busy = self.runtime.trunk.busy_s
        trunk_s, self._trunk_busy_seen = busy - self._trunk_busy_seen, busy
        finished = [float(r["virtual_s"]) for r in rows if r["status"] == "ok"]
        played = device_rounds(rows, trunk_s=trunk_s, trunk_flops=self._trunk_flops,
                               trunk_of=self._trunk_of, waits=self._waits)
        sequential = outcome is not None and not outcome.parallel
        if not played:  # nobody finished: the trunk's work is what the round is known to cost
            seconds = trunk_s if rows else 0.0
        else:
            seconds = (sequential_round_seconds if sequential else round_seconds)(played)
        return {"trunk_s": trunk_s, "slowest_client_s": max(finished, default=0.0),
                "virtual_round_s": seconds, "virtual_time_s": self.clock.advance(seconds)}

    def close(self) -> None:
        """Close the progress bar."""
        self.progress.close()

    def _print_progress(self, server_round: int, metrics: dict[str, float]) -> None:
        total = self.runtime.cfg.strategy.num_rounds
        elapsed = metrics["wall_s"]
        self._round_ends.append(elapsed)
        # The ETA uses recent rounds only: round 1 also pays for engine start-up.
        recent = np.diff(self._round_ends[1:][-6:])
        if not len(recent):
            recent = np.diff(self._round_ends[-2:])
        eta = float(recent.mean()) * (total - server_round) if len(recent) else float("nan")
        self.progress.write(
            f"[round {server_round:>3}/{total}] test acc {metrics['test_accuracy']:.4f} "
            f"loss {metrics['test_loss']:.4f} | virtual {metrics['virtual_time_s']:8.1f}s | "
            f"{elapsed:6.1f}s elapsed, ETA {eta:5.1f}s",
            file=sys.stdout,
        )
        if server_round:
            self.progress.update(1)


@dataclass(frozen=True)
class TrainingResult:
    """A finished run: per-round metrics and the joined model (client side + trunk)."""

    history: list[dict[str, float]]
    model: SplittableModel


#: Seconds between the ServerApp's looks for replies in the Simulation Engine's in-memory
#: link. Flower's 0.1 s leaves the trunk idle 50 ms a round on average after the last
#: reply, and a look is a scan of a few dictionaries under a lock.
REPLY_POLL_S = 0.01


def collect_replies_promptly(grid: Grid) -> None:
    """Look for replies every :data:`REPLY_POLL_S` in the Simulation Engine.

    The Deployment Engine's grid keeps Flower's polling: there a faster one made rounds
    slower on 2 cores (benchmarks/results/2026-12-deployment.md).
    """
    if isinstance(grid, InMemoryGrid):
        grid.pull_interval = REPLY_POLL_S


def run_training(grid: Grid, runtime: SplitRuntime) -> TrainingResult:
    """Run the protocol for the configured rounds; save and return the final model."""
    cfg = runtime.cfg
    reporter = RoundReporter(runtime)
    strategy = make_strategy(runtime, reporter)
    initial = initial_arrays(runtime)
    if (resumed := runtime.resumed) is not None:
        initial = restore_run(runtime, resumed, reporter, strategy)
        strategy = ResumedRounds(strategy, done=resumed.server_round)
    if cfg.checkpoint:
        reporter.after_round = lambda server_round, arrays: save_checkpoint(
            runtime.run_dir, run_checkpoint(runtime, server_round, arrays, reporter, strategy))
    try:
        result = strategy.start(
            grid=grid, initial_arrays=initial, num_rounds=cfg.strategy.num_rounds,
            timeout=cfg.strategy.round_timeout_s, evaluate_fn=reporter,
        )
    finally:
        reporter.close()
    final = joined_model(runtime, result.arrays if result.arrays is not None else initial)
    # The user's own module's state dict (the zoo network's for zoo models).
    torch.save(source_module(final).state_dict(), runtime.run_dir / "model.pt")
    refusals = runtime.workers.refusals() if runtime.workers else runtime.endpoint.refusals
    if refusals:
        log.warning("data plane refused frames: %s", dict(refusals))
    return TrainingResult(reporter.history, final)


def run_checkpoint(runtime: SplitRuntime, server_round: int, arrays: ArrayRecord,
                   reporter: RoundReporter, strategy: Strategy) -> RunCheckpoint:
    """Everything round ``server_round + 1`` starts from (see :mod:`server.checkpoint`)."""
    devices = runtime.spec.devices
    return RunCheckpoint(
        server_round=server_round, arrays={k: v.numpy() for k, v in arrays.items()},
        trunk=runtime.trunk.state_dict(), strategy=strategy.checkpoint(),  # type: ignore[attr-defined]
        reporter=reporter.checkpoint(), sinks=runtime.sinks.checkpoint(),
        config=to_container(runtime.cfg),
        measured={"host_flops_per_s": devices.host_flops_per_s,
                  "host_flops_by_cut": dict(devices.host_flops_by_cut)},
        rng=random_states(),
    )


def restore_run(runtime: SplitRuntime, resumed: RunCheckpoint, reporter: RoundReporter,
                strategy: Strategy) -> ArrayRecord:
    """Bring the trunk, strategy, reporter and sinks back to ``resumed``; return its arrays."""
    runtime.trunk.load_state_dict(resumed.trunk)
    strategy.restore(resumed.strategy)  # type: ignore[attr-defined]
    reporter.restore(resumed.reporter)
    runtime.sinks.restore(resumed.sinks)
    restore_random_states(resumed.rng)
    log.info("resuming %s after round %d of %d", runtime.run_dir, resumed.server_round,
             runtime.cfg.strategy.num_rounds)
    return ArrayRecord({k: Array(v) for k, v in resumed.arrays.items()})


def config_from_run_config(run_config: dict[str, Any]) -> DictConfig:
    """Compose the Hydra config for ``flwr run`` from the run config.

    ``overrides`` holds Hydra overrides separated by spaces (shell quoting
    allowed); ``run-dir`` is where the run folder goes.
    """
    cfg = compose_config(shlex.split(str(run_config.get("overrides", ""))))
    stamp = time.strftime("%Y-%m-%d/%H-%M-%S")
    cfg.run_dir = str(run_config.get("run-dir") or f"outputs/flwr/{stamp}")
    return cfg


#: The project's loggers (Flower's own logger keeps its own handler).
PROJECT_LOGGERS = ("server", "strategies", "splitlearn", "clients", "experiments", "protocols")
#: Flower's logger: its rounds, samples and replies (it prints them itself).
FLOWER_LOGGER = "flwr"
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


@contextmanager
def run_log(run_dir: str | Path) -> Iterator[None]:
    """Send the project's and Flower's INFO logs to ``run_dir/run.log`` while a run lasts.

    ``python -m experiments.run`` has Hydra's logging for this (the root logger, which
    Flower's logger reaches too); a ServerApp that the SuperLink starts (``flwr run``)
    has none. The project's lines also go to stderr, which ``flwr run --stream`` and
    ``flwr log`` show; Flower's logger prints its own there already.
    """
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    file = logging.FileHandler(Path(run_dir) / "run.log")
    file.setLevel(logging.INFO)  # Flower's logger passes DEBUG lines on
    handlers = [file, logging.StreamHandler()]
    for handler in handlers:
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
    loggers = [logging.getLogger(name) for name in PROJECT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
        for handler in handlers:
            logger.addHandler(handler)
    flower = logging.getLogger(FLOWER_LOGGER)
    flower.addHandler(file)
    try:
        yield
    finally:
        flower.removeHandler(file)
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
            for handler in handlers:
                logger.removeHandler(handler)
        for handler in handlers:
            handler.close()


def deployed_config(run_config: dict[str, Any]) -> DictConfig:
    """Return the config of a run started by ``flwr run``: node keys on unless set off.

    A SuperLink may have real devices connected, so by default each token is bound to
    its node's key (``dataplane.node_keys``); ``experiments.run`` leaves them off.
    """
    cfg = config_from_run_config(run_config)
    if cfg.dataplane.node_keys is None:
        cfg.dataplane.node_keys = True
    return cfg


def build_server_app(cfg: DictConfig | None = None) -> ServerApp:
    """Build the ServerApp; with ``cfg=None`` the config comes from the run config.

    Without a config (``flwr run``) the ServerApp also keeps its own log in the run
    folder (:func:`run_log`), as Hydra does for ``python -m experiments.run``.
    """
    server_app = ServerApp()
    runtimes: list[SplitRuntime] = []  # one per lifespan; a list keeps it re-entrant

    @server_app.lifespan()
    def lifespan(context: Context) -> Iterator[None]:
        run_cfg = cfg if cfg is not None else deployed_config(dict(context.run_config))
        with run_log(run_cfg.run_dir) if cfg is None else nullcontext():
            runtime = start_runtime(run_cfg)
            runtimes.append(runtime)
            try:
                yield
            finally:
                runtimes.remove(runtime)
                stop_runtime(runtime)

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        collect_replies_promptly(grid)
        run_training(grid, runtimes[-1])

    return server_app


#: The ServerApp that ``flwr run .`` loads (see ``[tool.flwr.app.components]``).
app = build_server_app()
