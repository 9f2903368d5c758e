"""Metrics sink interface, fan-out, and the factory the server uses.

The server side of a run talks to exactly one object, a :class:`CompositeSink`
built by :func:`make_sinks`. It always contains a :class:`FileSink` (the run
folder is the record of truth) and, when asked for, a :class:`WandbSink`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

from splitlearn.tracking.files import FileSink
from splitlearn.tracking.wandb_sink import WandbSink

_LOG = logging.getLogger(__name__)

#: Accepted values of ``make_sinks(logger=...)``.
LOGGERS: tuple[str, ...] = ("wandb", "none")


@runtime_checkable
class MetricsSink(Protocol):
    """Something that records the metrics of one training run."""

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the resolved run configuration (a nested mapping)."""
        ...

    def log_round(self, server_round: int, metrics: Mapping[str, float | int]) -> None:
        """Record the aggregate metrics of one server round."""
        ...

    def log_clients(self, server_round: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Record one row per client that took part in ``server_round``."""
        ...

    def close(self) -> None:
        """Flush and release everything; the sink is not used afterwards."""
        ...


class CompositeSink:
    """Forward every call to several sinks, in order.

    Every sink gets every call even when an earlier one raises, so that a W&B
    hiccup never costs the local files; the first error is re-raised once all
    sinks have been called and later errors are logged.

    Parameters
    ----------
    sinks : Iterable[MetricsSink]
        The sinks to forward to. Order matters for :meth:`close`: a sink that
        reads files another one writes on close must come after it.
    """

    def __init__(self, sinks: Iterable[MetricsSink]) -> None:
        self._sinks = tuple(sinks)
        self._closed = False

    @property
    def sinks(self) -> tuple[MetricsSink, ...]:
        """tuple[MetricsSink, ...]: The wrapped sinks, in call order."""
        return self._sinks

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Forward :meth:`MetricsSink.log_config` to every sink."""
        self._fan_out(lambda sink: sink.log_config(config))

    def log_round(self, server_round: int, metrics: Mapping[str, float | int]) -> None:
        """Forward :meth:`MetricsSink.log_round` to every sink."""
        self._fan_out(lambda sink: sink.log_round(server_round, metrics))

    def log_clients(self, server_round: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Forward :meth:`MetricsSink.log_clients` to every sink."""
        self._fan_out(lambda sink: sink.log_clients(server_round, rows))

    def checkpoint(self) -> dict[str, Any]:
        """Return every sink's state (the files' rows, the W&B run's id)."""
        state: dict[str, Any] = {}
        for sink in self._sinks:
            if hasattr(sink, "checkpoint"):
                state |= sink.checkpoint()
        return state

    def restore(self, saved: Mapping[str, Any]) -> None:
        """Continue every sink that can from :meth:`checkpoint`'s state."""
        for sink in self._sinks:
            if hasattr(sink, "restore"):
                sink.restore(saved)

    def close(self) -> None:
        """Close every sink, even if some raise; re-raise the first error.

        Calling it again is a no-op.
        """
        if self._closed:
            return
        self._closed = True
        self._fan_out(lambda sink: sink.close())

    def __enter__(self) -> CompositeSink:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _fan_out(self, call: Callable[[MetricsSink], None]) -> None:
        first: Exception | None = None
        for sink in self._sinks:
            try:
                call(sink)
            except Exception as err:  # collected; the first is re-raised below
                if first is None:
                    first = err
                else:
                    _LOG.error("%s failed as well", type(sink).__name__, exc_info=err)
        if first is not None:
            raise first


def make_sinks(
    *,
    run_dir: Path,
    logger: str,
    project: str = "splitlearn",
    group: str | None = None,
    tags: Sequence[str] = (),
    run_name: str | None = None,
    wandb_mode: str = "auto",
    wandb_resume_id: str | None = None,
    plots: bool = True,
) -> CompositeSink:
    """Build the sinks of one run.

    Parameters
    ----------
    run_dir : Path
        Run folder; created if missing. Files (and the ``wandb/`` folder) go
        here.
    logger : str
        ``"none"``: files only. ``"wandb"``: files plus Weights & Biases.
    project, group, tags, run_name
        W&B run metadata; ignored for ``logger="none"``.
    wandb_mode : str
        ``"auto"``, ``"online"``, ``"offline"`` or ``"disabled"``; see
        :func:`~splitlearn.tracking.wandb_sink.resolve_mode`.
    wandb_resume_id : str | None
        Continue this W&B run (a resumed run) instead of starting a new one.
    plots : bool
        Whether the run folder gets its PNG plots when the run ends.

    Returns
    -------
    CompositeSink
        A :class:`FileSink` first, then the optional :class:`WandbSink`.

    Raises
    ------
    ValueError
        If ``logger`` is not one of :data:`LOGGERS`.
    """
    # Validate before creating anything so a typo leaves no half-made run.
    if logger not in LOGGERS:
        accepted = ", ".join(repr(name) for name in LOGGERS)
        raise ValueError(f"unknown logger {logger!r}; accepted: {accepted}")
    # FileSink first: its close() writes the PNGs that WandbSink.close() uploads.
    sinks: list[MetricsSink] = [FileSink(run_dir, plots=plots)]
    if logger == "wandb":
        sinks.append(
            WandbSink(
                run_dir=run_dir,
                project=project,
                group=group,
                tags=tags,
                run_name=run_name,
                mode=wandb_mode,
                resume_id=wandb_resume_id,
            )
        )
    return CompositeSink(sinks)
