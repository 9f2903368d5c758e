"""Hydra entry point: ``python -m experiments.run [+scenario=NAME] [key=value ...]``.

Composes the typed config, then runs the ServerApp and ClientApp in Flower's
Simulation Engine inside this process. Results land in Hydra's run folder
(``outputs/DATE/TIME``): config.json, metrics.json/csv, clients.csv, PNG plots
and the W&B run.

Why ``flwr.simulation.run_simulation`` and not a ``flwr run`` subprocess: it runs
the same Simulation Engine that ``flwr run`` uses for local simulation, but in
this process, so Hydra owns the run folder, the composed config is passed as an
object (no lossy flattening into a run config), and no SuperLink daemon is left
behind. Flower marks the function deprecated; the project pins ``flwr`` to the
minor version it is tested with, and :mod:`server.app` also serves ``flwr run .``
with the same apps, so the supported CLI path keeps working either way.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

# Flower and flwr-datasets read this at import; runs here must not phone home. Ray's usage
# reports also cost every run a process of their own.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from protocols import check_config, register_configs  # noqa: E402
from splitlearn.config import check_overrides  # noqa: E402

log = logging.getLogger(__name__)


def simulation_backend_config(cfg: DictConfig, ray_tmp: str) -> dict[str, Any]:
    """Ray backend settings for Flower's Simulation Engine."""
    init_args: dict[str, Any] = {"_temp_dir": ray_tmp, "logging_level": logging.WARNING}
    if cfg.engine.ray_address:
        # Attach to an existing cluster; its workers must reach the trunk at
        # dataplane.advertise_host.
        init_args = {"address": cfg.engine.ray_address, "logging_level": logging.WARNING}
    return {
        "client_resources": {"num_cpus": cfg.engine.num_cpus_per_client, "num_gpus": 0.0},
        "init_args": init_args,
    }


def launch_simulation(cfg: DictConfig) -> None:
    """Run the configured experiment in Flower's Simulation Engine."""
    from flwr.simulation import run_simulation

    from clients.app import app as client_app
    from experiments.node_index import node_indexed_link_state
    from server.app import build_server_app

    if cfg.engine.name != "simulation":
        raise ValueError(f"engine.name={cfg.engine.name!r}; accepted here: 'simulation'")
    # Ray's socket paths must stay short, so its folder goes under the system tmp.
    with tempfile.TemporaryDirectory(prefix="ray-") as ray_tmp:
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        backend_config = simulation_backend_config(cfg, ray_tmp)
        start_ray(backend_config["init_args"])
        try:
            # Flower's engine polls every node each tick, and only every 0.1 s.
            with node_indexed_link_state():
                run_simulation(
                    server_app=build_server_app(cfg),
                    client_app=client_app,
                    num_supernodes=cfg.num_clients,
                    backend_config=backend_config,
                )
        except Exception:
            # The engine died (e.g. Ray lost a process). Flower's ServerApp thread is
            # not a daemon and would wait out the round timeout for replies that can
            # no longer come, so report and leave now.
            traceback.print_exc()
            _shutdown_ray()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        _shutdown_ray()


def start_ray(init_args: dict[str, Any], *, attempts: int = 3) -> None:
    """Start (or attach to) Ray before Flower does, retrying a failed start.

    On a loaded machine with few cores, Ray's raylet can miss its fixed 30 s
    registration window ("The current node timed out during startup"). Flower
    starts Ray only if it is not running yet, so starting it here, with retries,
    keeps that flake out of the run. The runtime environment matches Flower's
    (workers see this process's ``sys.path``).
    """
    import ray

    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath
    for attempt in range(1, attempts + 1):
        try:
            with warnings.catch_warnings():
                # A tip about GPUs in a later Ray; the ClientApps' actors ask for none.
                warnings.filterwarnings("ignore", "Tip: In future versions of Ray",
                                        FutureWarning)
                context = ray.init(
                    runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
                    include_dashboard=False,
                    **init_args,
                )
            # Where to look when a ClientApp seems stuck (its worker's logs are there).
            log.info("Ray's logs: %s", os.path.join(context.address_info["session_dir"], "logs"))
            return
        except Exception as err:  # Ray raises plain Exception on start-up timeouts
            log.warning("Ray did not start (attempt %d of %d): %s", attempt, attempts, err)
            _shutdown_ray()
            if attempt == attempts:
                raise
            time.sleep(2.0 * attempt)


def _shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """Run one experiment; return the final test accuracy (for sweeps)."""
    cfg.run_dir = HydraConfig.get().runtime.output_dir
    # A run that seems stuck says where: `kill -USR1 PID` prints every thread's stack.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Flower logs through its own handler; without this every line shows twice
    # (once more through the root handler Hydra installs).
    logging.getLogger("flwr").propagate = False
    # Flower's link state imports alembic, whose plugins announce themselves at INFO.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    check_config(cfg)  # before Ray and the trunk start: a bad key fails in a second
    launch_simulation(cfg)
    metrics = Path(cfg.run_dir) / "metrics.json"
    print(f"run folder: {cfg.run_dir}", flush=True)
    if metrics.exists():
        import json

        rounds = json.loads(metrics.read_text())
        return float(rounds[-1].get("test_accuracy", "nan")) if rounds else None
    return None


if __name__ == "__main__":
    try:  # Hydra would refuse a renamed key without naming the new one
        check_overrides(arg for arg in sys.argv[1:] if not arg.startswith("-"))
    except ValueError as err:
        sys.exit(f"error: {err}")
    register_configs()
    main()
