"""Weights & Biases metrics sink that works without a network.

Where things go
---------------
``wandb.init(dir=run_dir)`` puts the whole ``wandb/`` folder (run files,
logs, media, and ``offline-run-*`` with its ``.wandb`` log) inside the run
folder. ``WANDB_CACHE_DIR``, ``WANDB_CONFIG_DIR`` and ``WANDB_DATA_DIR`` are
left alone on purpose: they are per-user, not per-run (artifact cache shared
across runs, the user's login settings, artifact staging), wandb 0.31 has no
``Settings`` field for them, and setting them through ``os.environ`` would
change the whole process and every child it spawns (Ray workers included).
Set them in the environment of the job if they must move.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: Accepted ``mode`` values of :class:`WandbSink` and :func:`resolve_mode`.
MODES: tuple[str, ...] = ("auto", "online", "offline", "disabled")

_LOG = logging.getLogger(__name__)
# WANDB_MODE values wandb itself accepts, mapped onto ours.
_ENV_MODES: Mapping[str, str] = {
    "online": "online",
    "run": "online",
    "offline": "offline",
    "dryrun": "offline",
    "disabled": "disabled",
}
_PLOTS = ("metrics.png", "clients.png", "accuracy_time.png", "client_time.png")


def resolve_mode(mode: str = "auto") -> str:
    """Turn ``mode`` into the mode passed to ``wandb.init``.

    Parameters
    ----------
    mode : str
        ``"online"``, ``"offline"`` and ``"disabled"`` are returned as they
        are. ``"auto"`` honours a valid ``WANDB_MODE`` variable if set (the
        usual W&B switch), and otherwise gives ``"online"`` when W&B finds
        credentials (see :func:`has_credentials`) and ``"offline"`` if not.

    Returns
    -------
    str
        ``"online"``, ``"offline"`` or ``"disabled"``.

    Raises
    ------
    ValueError
        If ``mode`` is not one of :data:`MODES`.
    """
    if mode not in MODES:
        accepted = ", ".join(repr(m) for m in MODES)
        raise ValueError(f"unknown W&B mode {mode!r}; accepted: {accepted}")
    if mode != "auto":
        return mode
    forced = _ENV_MODES.get(os.environ.get("WANDB_MODE", "").strip().lower())
    if forced is not None:
        return forced
    return "online" if has_credentials() else "offline"


def has_credentials() -> bool:
    """Tell whether W&B finds credentials for its configured server.

    W&B's own lookup (its API key and identity-token variables, the netrc entry
    ``wandb login`` writes, its settings) for the host of ``WANDB_BASE_URL`` or its
    default, without prompting and without a network call. Credentials W&B finds
    malformed count as none (with a warning): the run then stays offline.
    """
    import wandb
    from wandb.sdk.lib.wbauth import authenticate_session

    host = os.environ.get("WANDB_BASE_URL", "").strip() or wandb.Settings().base_url
    try:
        found = authenticate_session(
            host=host, source="splitlearn", prompt=False, update_session=False,
        )
    except wandb.errors.AuthenticationError as err:
        _LOG.warning("W&B credentials refused (%s); logging offline", err)
        return False
    return found is not None


class WandbSink:
    """Log a run to Weights & Biases (online, offline or disabled).

    Parameters
    ----------
    run_dir : Path
        Run folder; ``wandb/`` is created inside it.
    project : str
        W&B project.
    group : str | None
        W&B group, e.g. one per experiment sweep.
    tags : Sequence[str]
        W&B tags.
    run_name : str | None
        W&B display name; W&B picks one when ``None``.
    mode : str
        One of :data:`MODES`; see :func:`resolve_mode`.

    Raises
    ------
    ImportError
        If ``wandb`` is not installed.
    ValueError
        If ``mode`` is unknown.

    Notes
    -----
    Rounds are logged with ``step=server_round``; W&B drops (with a warning)
    anything logged at a step lower than one already logged, so rounds must
    be logged in increasing order. Several calls for the same round are fine.
    """

    def __init__(
        self,
        *,
        run_dir: Path,
        project: str,
        group: str | None,
        tags: Sequence[str],
        run_name: str | None,
        mode: str = "auto",
        resume_id: str | None = None,
    ) -> None:
        self.mode = resolve_mode(mode)
        try:
            import wandb
        except ImportError as err:
            raise ImportError(
                "logger='wandb' needs the wandb package (pip install wandb); "
                "use logger='none' for files only"
            ) from err
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self._closed = False
        self._run = wandb.init(
            project=project,
            group=group,
            tags=list(tags) or None,
            name=run_name,
            dir=str(self.run_dir),
            mode=self.mode,
            # A resumed run (the ServerApp restarted) continues the same W&B run.
            id=resume_id,
            resume="allow" if resume_id else None,
            # One sink, one run: never hand back (and later finish) a run
            # that another sink in this process still uses.
            reinit="create_new",
            settings=wandb.Settings(
                silent=True,  # no "wandb: ..." banner lines
                console="off",  # our logs are already in files; no stdout hook
                x_disable_stats=True,  # no system-metrics sampler
            ),
        )

    def checkpoint(self) -> dict[str, Any]:
        """Return what a resumed run needs to continue this W&B run: its id."""
        return {"wandb_id": self._run.id}

    @property
    def run(self) -> Any:
        """wandb.Run: The underlying run (e.g. for ``run.url``)."""
        return self._run

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Set the run config; later calls may change values."""
        self._run.config.update(dict(config), allow_val_change=True)

    def log_round(self, server_round: int, metrics: Mapping[str, float | int]) -> None:
        """Log round metrics at ``step=server_round``, plus a ``round`` value."""
        self._run.log(dict(metrics) | {"round": server_round}, step=server_round)

    def log_clients(self, server_round: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Log the per-client rows of one round as a ``clients`` table."""
        if not rows:
            return
        columns = [
            "round",
            *dict.fromkeys(k for row in rows for k in row if k != "round"),
        ]
        data = [[server_round, *(row.get(c) for c in columns[1:])] for row in rows]
        # Ids may be int in one row and str in another; don't let that raise.
        table = self._wandb.Table(columns=columns, data=data, allow_mixed_types=True)
        self._run.log({"clients": table}, step=server_round)

    def close(self) -> None:
        """Log the run folder's PNG plots, if any, then finish the run.

        Calling it again is a no-op.
        """
        if self._closed:
            return
        self._closed = True
        try:
            images = {
                f"plots/{Path(name).stem}": self._wandb.Image(str(self.run_dir / name))
                for name in _PLOTS
                if (self.run_dir / name).is_file()
            }
            if images:
                self._run.log(images)
        finally:
            self._run.finish()
