"""The Flower ServerApp: trunk service in ``lifespan``, SplitFed in ``main``.

Two ways in, one code path:

* ``experiments.run`` (Hydra) composes the config and calls
  :func:`build_server_app` with it, then runs Flower's Simulation Engine.
* ``flwr run .`` loads the module-level :data:`app`, which composes the config
  from the run config's ``overrides`` string (Hydra override syntax).
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from server.async_trunk import AsyncTrunkTrainer, train_smashed_batch
from server.trunk import Trunk
from server.trunk_modes import BatchingTrunk, TrunkPerClient
from server.trunk_service import TokenRegistry, TrunkEndpoint, TrunkService
from splitlearn.aux_head import without_aux
from splitlearn.calibration import measure_host_flops_per_s
from splitlearn.config import compose_config, to_container
from splitlearn.data import describe_dataset, load_test_data
from splitlearn.evaluation import evaluate_model
from splitlearn.models import SplittableModel, build_model
from splitlearn.planning.clock import VirtualClock, round_time
from splitlearn.planning.devices import DeviceProfile, build_fleet
from splitlearn.privacy import PrivacySettings, with_release_at_cut
from splitlearn.split import load_bottom_state, resolve_tail_cut
from splitlearn.task import SplitTask
from splitlearn.tracking import CompositeSink, make_sinks
from splitlearn.wire import record_to_state
from strategies.fedavg import FedAvgBaseline
from strategies.local_loss import LocalLossSplit
from strategies.privacy import PrivacyBudgetGuard
from strategies.sequential import SequentialSplit
from strategies.splitfed import SplitFed
from strategies.ushaped import UShapedSplit

log = logging.getLogger(__name__)


@dataclass
class SplitRuntime:
    """Everything that lives for one run on the server side."""

    cfg: DictConfig
    run_dir: Path
    model: SplittableModel
    trunk: Trunk
    tokens: TokenRegistry
    endpoint: TrunkEndpoint
    service: TrunkService
    sinks: CompositeSink
    fleet: list[DeviceProfile] | None  # profile per partition id; None: no emulation
    host_flops_per_s: float  # this host's training FLOP/s (0: not needed)


def build_model_for(cfg: DictConfig) -> SplittableModel:
    """Build the configured model, seeded, sized for the configured dataset."""
    spec = describe_dataset(cfg.dataset.name, image_size=cfg.dataset.image_size)
    model = build_model(
        cfg.model.name,
        in_channels=spec.in_channels,
        image_size=spec.image_size,
        num_classes=spec.num_classes,
        seed=cfg.seed,
        **OmegaConf.to_container(cfg.model.options),
    )
    model.check_cut(cfg.model.cut)
    return model


def build_endpoint(cfg: DictConfig) -> TrunkEndpoint:
    """Build the seeded model, its trunk and the frame endpoint in front of it."""
    s = cfg.strategy
    trunk = Trunk(build_model_for(cfg), lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay)
    return TrunkEndpoint(
        trunk, TokenRegistry(), max_frame_bytes=cfg.dataplane.max_frame_bytes,
        max_batch=cfg.dataplane.max_batch,
    )


def start_runtime(cfg: DictConfig) -> SplitRuntime:
    """Build the model and trunk, start the trunk service, open the sinks."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.dataplane.trunk_threads)
    endpoint = build_endpoint(cfg)
    trunk, tokens, model = endpoint.trunk, endpoint.tokens, endpoint.trunk.model
    service = TrunkService(
        endpoint, host=cfg.dataplane.host, port=cfg.dataplane.port,
        advertise_host=cfg.dataplane.advertise_host,
    )
    service.start()
    sinks = make_sinks(
        run_dir=run_dir, logger=cfg.logger.name, project=cfg.logger.project,
        group=cfg.logger.group, tags=list(cfg.logger.tags), wandb_mode=cfg.logger.mode,
    )
    sinks.log_config(to_container(cfg))
    fleet = build_fleet_for(cfg)
    host_flops = host_flops_for(cfg, model) if fleet else 0.0
    return SplitRuntime(
        cfg, run_dir, model, trunk, tokens, endpoint, service, sinks, fleet, host_flops
    )


def build_fleet_for(cfg: DictConfig) -> list[DeviceProfile] | None:
    """Profiles by partition id for the configured device mix (None: no devices)."""
    devices = to_container(cfg.devices)
    return build_fleet(
        num_clients=cfg.num_clients, mix=devices["mix"], profiles=devices["profiles"],
        seed=cfg.seed,
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


def stop_runtime(runtime: SplitRuntime) -> None:
    """Stop the trunk service and close the sinks (writes plots)."""
    runtime.service.stop()
    runtime.sinks.close()


def make_task_template(
    cfg: DictConfig, trunk_address: str, *, host_flops_per_s: float = 0.0
) -> SplitTask:
    """Build the per-round client task, minus the per-client token and round."""
    devices = to_container(cfg.devices)
    fleet = {"mix": devices["mix"], "profiles": devices["profiles"]} if devices["mix"] else None
    return SplitTask(
        server_round=0,
        cut=cfg.model.cut,
        model=cfg.model.name,
        model_options=json.dumps(OmegaConf.to_container(cfg.model.options)),
        dataset=cfg.dataset.name,
        dataset_path=cfg.dataset.path or "",
        test_fraction=cfg.dataset.test_fraction,
        image_size=cfg.dataset.image_size or 0,
        partitioner=cfg.partitioner.name,
        alpha=cfg.partitioner.alpha,
        shards_per_partition=cfg.partitioner.shards_per_partition,
        seed=cfg.seed,
        local_epochs=cfg.strategy.local_epochs,
        batch_size=cfg.strategy.batch_size,
        lr=cfg.strategy.lr,
        momentum=cfg.strategy.momentum,
        weight_decay=cfg.strategy.weight_decay,
        trunk_address=trunk_address,
        token="",
        max_frame_bytes=cfg.dataplane.max_frame_bytes,
        torch_threads=cfg.engine.torch_threads,
        devices=json.dumps(fleet) if fleet else "",
        host_flops_per_s=host_flops_per_s,
        emulate=int(cfg.devices.emulate),
        dropout_rate=cfg.failures.dropout_rate,
        dropout_after_steps=cfg.failures.dropout_after_steps,
        privacy=cfg.privacy.name,
        privacy_clip_norm=cfg.privacy.clip_norm,
        privacy_noise_multiplier=cfg.privacy.noise_multiplier,
        privacy_delta=cfg.privacy.delta,
        privacy_epsilon_max=cfg.privacy.epsilon_max or 0.0,
        aux_hidden=cfg.strategy.aux_hidden,
        bulk=int(cfg.strategy.bulk),
        tail_cut=cfg.model.tail_cut,
    )


def make_strategy(runtime: SplitRuntime) -> SplitFed:
    """Build the configured protocol's strategy (and set the trunk mode it needs)."""
    cfg = runtime.cfg
    s = cfg.strategy
    if s.name not in PROTOCOLS:
        raise ValueError(f"strategy.name={s.name!r}; accepted: {', '.join(sorted(PROTOCOLS))}")

    def issue(client: str, cut: int, server_round: int) -> str:
        return runtime.tokens.issue(
            client=client, cut=cut, server_round=server_round,
            ttl_s=cfg.dataplane.token_ttl_s,
        )

    common: dict[str, Any] = {
        "task": make_task_template(
            cfg, runtime.service.address, host_flops_per_s=runtime.host_flops_per_s
        ),
        "issue_token": issue,
        "revoke_round": runtime.tokens.revoke_round,
        "round_deadline_s": cfg.failures.round_deadline_s,
        "fraction_train": s.fraction_train,
        "fraction_evaluate": s.fraction_evaluate,
        "min_train_nodes": s.min_train_nodes,
        "min_evaluate_nodes": s.min_train_nodes if s.fraction_evaluate > 0 else 0,
        "min_available_nodes": s.min_train_nodes,
    }
    strategy = PROTOCOLS[s.name](runtime, common)
    # Privacy wraps the protocol (as Flower's DP wrappers do); attributes pass through.
    if cfg.privacy.name == "none":
        return strategy
    if strategy.train_message_type != "train.split":  # only the split client loop applies it
        raise ValueError(
            f"privacy={cfg.privacy.name!r} applies to protocols whose clients run the split "
            f"training loop (splitfed_v2, splitfed_v1, sequential), not strategy={s.name!r}"
        )
    return PrivacyBudgetGuard(strategy)  # type: ignore[return-value]


def _splitfed_v2(runtime: SplitRuntime, common: dict[str, Any]) -> SplitFed:
    """One shared trunk; optionally one step over concurrently connected clients."""
    s = runtime.cfg.strategy
    if s.batch_concurrent:
        runtime.endpoint.mode = BatchingTrunk(
            runtime.trunk, open_streams=lambda: runtime.service.open_streams,
            timeout_s=s.barrier_timeout_s,
        )
    return SplitFed(**common)


def _splitfed_v1(runtime: SplitRuntime, common: dict[str, Any]) -> SplitFed:
    """Give each client a trunk copy, merged over the clients that finished."""
    runtime.endpoint.mode = TrunkPerClient(runtime.trunk)
    return SplitFed(merge_round=runtime.endpoint.mode.finish_round, **common)


def _sequential(runtime: SplitRuntime, common: dict[str, Any]) -> SplitFed:
    """Clients take turns on the shared trunk."""
    return SequentialSplit(turn_timeout_s=runtime.cfg.strategy.round_timeout_s, **common)


def _fedavg(runtime: SplitRuntime, common: dict[str, Any]) -> SplitFed:
    """Whole-model FedAvg baseline (the trunk service idles)."""
    return FedAvgBaseline(**common)


def _local_loss(runtime: SplitRuntime, common: dict[str, Any]) -> SplitFed:
    """Clients train against an aux head; the trunk trains on their smashed data apart."""
    cfg = runtime.cfg
    s = cfg.strategy
    if s.bulk:  # smashed data arrives in the replies; the strategy trains the trunk
        def train_batch(client: str, cut: int, acts: torch.Tensor, labels: torch.Tensor) -> None:
            train_smashed_batch(runtime.endpoint, client, cut, acts, labels)

        return LocalLossSplit(aux_hidden=s.aux_hidden, train_batch=train_batch, **common)
    trainer = AsyncTrunkTrainer(max_queue=s.queue_batches, drain_timeout_s=s.round_timeout_s)
    runtime.endpoint.smashed = trainer
    return LocalLossSplit(aux_hidden=s.aux_hidden, merge_round=trainer.finish_round, **common)


def _ushaped(runtime: SplitRuntime, common: dict[str, Any]) -> SplitFed:
    """Head, tail and loss on the device; the shared trunk runs the stages between."""
    cfg = runtime.cfg
    tail_cut = resolve_tail_cut(runtime.model, cfg.model.cut, cfg.model.tail_cut)

    def issue(client: str, cut: int, server_round: int) -> str:
        # A grant with a tail cut makes the trunk treat the session as U-shaped.
        return runtime.tokens.issue(
            client=client, cut=cut, server_round=server_round,
            ttl_s=cfg.dataplane.token_ttl_s, tail_cut=tail_cut,
        )

    task = replace(common["task"], tail_cut=tail_cut)
    return UShapedSplit(**(common | {"task": task, "issue_token": issue}))


#: ``strategy.name`` -> builder of the strategy (which also sets the trunk mode).
PROTOCOLS: dict[str, Callable[[SplitRuntime, dict[str, Any]], SplitFed]] = {
    "fedavg": _fedavg,
    "splitfed_v2": _splitfed_v2,
    "splitfed_v1": _splitfed_v1,
    "sequential": _sequential,
    "local_loss": _local_loss,
    "ushaped": _ushaped,
}


class RoundReporter:
    """Flower's ``evaluate_fn`` hook: centralised test, then log the round.

    Called by ``Strategy.start`` before round 1 (round 0) and after each round.
    It evaluates the aggregated client side joined with the current trunk on
    the held-out test split, merges the round's aggregated training metrics,
    advances the virtual clock (slowest finished client plus the trunk's busy
    time), writes everything to every sink and updates the progress bar.
    """

    def __init__(self, runtime: SplitRuntime, strategy: SplitFed) -> None:
        self.runtime = runtime
        self.strategy = strategy
        cfg = runtime.cfg
        test = load_test_data(
            dataset=cfg.dataset.name, seed=cfg.seed, path=cfg.dataset.path,
            test_fraction=cfg.dataset.test_fraction, image_size=cfg.dataset.image_size,
        )
        self.test_loader = DataLoader(test, batch_size=512)
        self.started = time.perf_counter()
        self.history: list[dict[str, float]] = []
        self._round_ends: list[float] = []
        self.clock = VirtualClock()
        self._trunk_busy_seen = 0.0
        self.progress = tqdm(
            total=cfg.strategy.num_rounds, unit="round", desc="training", dynamic_ncols=True
        )

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Evaluate and log ``server_round``; return the test metrics."""
        model = self.runtime.trunk.snapshot()
        # Protocol extras (the local-loss aux head) are not part of the evaluated model.
        load_bottom_state(model, without_aux(record_to_state(arrays)))
        deployed = with_release_at_cut(  # the trunk only ever sees released rows
            model, cut=self.runtime.cfg.model.cut,
            settings=PrivacySettings.from_config(self.runtime.cfg.privacy),
        )
        loss, accuracy, _ = evaluate_model(deployed, self.test_loader)
        metrics: dict[str, float] = {
            "test_accuracy": accuracy,
            "test_loss": loss,
            "wall_s": time.perf_counter() - self.started,
        }
        metrics |= self._train_metrics(server_round)
        rows = [self._with_profile(row) for row in self.strategy.client_rows.get(server_round, [])]
        metrics |= self._advance_clock(rows)
        self.history.append({"round": server_round, **metrics})
        self.runtime.sinks.log_round(server_round, metrics)
        if rows:
            self.runtime.sinks.log_clients(server_round, rows)
        self._print_progress(server_round, metrics)
        return MetricRecord({"test-accuracy": accuracy, "test-loss": loss})

    def _with_profile(self, row: dict[str, Any]) -> dict[str, Any]:
        fleet = self.runtime.fleet
        if fleet is None:
            return row | {"profile": "host"}
        # Failed clients reply with an error, which carries no partition id.
        partition = row.get("partition_id")
        return row | {"profile": fleet[partition].name if partition is not None else "?"}

    def _advance_clock(self, rows: list[dict[str, Any]]) -> dict[str, float]:
        busy = self.runtime.trunk.busy_s
        trunk_s, self._trunk_busy_seen = busy - self._trunk_busy_seen, busy
        finished = [float(r["virtual_s"]) for r in rows if r["status"] == "ok"]
        sequential = not self.strategy.clients_in_parallel
        seconds = round_time(finished, trunk_s=trunk_s, sequential=sequential) if rows else 0.0
        return {
            "trunk_s": trunk_s,
            "virtual_round_s": seconds,
            "virtual_time_s": self.clock.advance(seconds),
        }

    def close(self) -> None:
        """Close the progress bar."""
        self.progress.close()

    def _train_metrics(self, server_round: int) -> dict[str, float]:
        train = self.strategy.train_metrics.get(server_round)
        if train is None:
            return {}
        renamed = {k.replace("-", "_"): float(v) for k, v in train.items()}
        renamed["examples"] = renamed.pop("num_examples", 0.0)
        return renamed

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
        self.progress.set_postfix(acc=f"{metrics['test_accuracy']:.4f}", refresh=True)


def run_training(grid: Grid, runtime: SplitRuntime) -> list[dict[str, float]]:
    """Run SplitFed for the configured rounds; return per-round metrics."""
    cfg = runtime.cfg
    strategy = make_strategy(runtime)
    reporter = RoundReporter(runtime, strategy)
    initial = strategy.initial_arrays(runtime.model)
    try:
        strategy.start(
            grid=grid,
            initial_arrays=initial,
            num_rounds=cfg.strategy.num_rounds,
            timeout=cfg.strategy.round_timeout_s,
            evaluate_fn=reporter,
        )
    finally:
        reporter.close()
    rejected = dict(runtime.endpoint.rejected)
    if rejected:
        log.warning("data plane refused frames: %s", rejected)
    return reporter.history


def config_from_run_config(run_config: dict[str, Any]) -> DictConfig:
    """Compose the Hydra config for ``flwr run`` from the run config.

    ``overrides`` holds Hydra overrides separated by spaces (shell quoting
    allowed); ``run-dir`` is where the run folder goes.
    """
    cfg = compose_config(shlex.split(str(run_config.get("overrides", ""))))
    stamp = time.strftime("%Y-%m-%d/%H-%M-%S")
    cfg.run_dir = str(run_config.get("run-dir") or f"outputs/flwr/{stamp}")
    return cfg


def build_server_app(cfg: DictConfig | None = None) -> ServerApp:
    """Build the ServerApp; with ``cfg=None`` the config comes from the run config.

    Parameters
    ----------
    cfg : DictConfig, optional
        A composed config (``experiments.run`` passes Hydra's). When omitted,
        :func:`config_from_run_config` composes one from ``context.run_config``.
    """
    server_app = ServerApp()
    runtimes: list[SplitRuntime] = []  # one per lifespan; a list keeps it re-entrant

    @server_app.lifespan()
    def lifespan(context: Context) -> Iterator[None]:
        runtime = start_runtime(cfg if cfg is not None else config_from_run_config(
            dict(context.run_config)))
        runtimes.append(runtime)
        try:
            yield
        finally:
            runtimes.remove(runtime)
            stop_runtime(runtime)

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        run_training(grid, runtimes[-1])

    return server_app


#: The ServerApp that ``flwr run .`` loads (see ``[tool.flwr.app.components]``).
app = build_server_app()
