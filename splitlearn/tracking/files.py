"""Plain-file metrics sink: JSON, CSV and PNG files in the run folder.

Files written in ``run_dir``:

``config.json``
    The resolved configuration, on :meth:`FileSink.log_config`.
``metrics.json`` / ``metrics.csv``
    One row per round (``"round"`` first), rewritten after every
    :meth:`FileSink.log_round` so a crashed run still leaves its data.
``clients.csv``
    One row per client and round; appended to, or rewritten with a wider
    header when a new key shows up.
``metrics.png`` / ``clients.png``
    Plots, on :meth:`FileSink.close`, when there is data to plot.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from splitlearn.atomic import write_atomic
from splitlearn.tracking.plots import (
    plot_accuracy_vs_time,
    plot_client_metrics,
    plot_client_time_breakdown,
    plot_round_metrics,
)

_LOG = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
METRICS_JSON = "metrics.json"
METRICS_CSV = "metrics.csv"
CLIENTS_CSV = "clients.csv"
METRICS_PNG = "metrics.png"
CLIENTS_PNG = "clients.png"
TIME_PNG = "accuracy_time.png"
CLIENT_TIME_PNG = "client_time.png"


class FileSink:
    """Write a run's config and metrics as files in ``run_dir``.

    Parameters
    ----------
    run_dir : Path
        Run folder; created if missing.
    plots : bool
        Whether :meth:`close` draws the PNG plots (the JSON and CSV files are
        always written).

    Notes
    -----
    Calling :meth:`log_round` twice for the same round merges the metrics
    into one row (e.g. fit metrics first, evaluation metrics later).
    """

    def __init__(self, run_dir: Path, *, plots: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.plots = plots
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._rounds: dict[int, dict[str, Any]] = {}
        self._client_rows: list[dict[str, Any]] = []
        self._client_columns: list[str] = []
        self._closed = False

    @property
    def rounds(self) -> list[dict[str, Any]]:
        """list[dict[str, Any]]: Copy of the per-round rows, by round."""
        return [dict(self._rounds[r]) for r in sorted(self._rounds)]

    @property
    def client_rows(self) -> list[dict[str, Any]]:
        """list[dict[str, Any]]: Copy of all per-client rows, in log order."""
        return [dict(row) for row in self._client_rows]

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Write ``config.json``."""
        write_atomic(self.run_dir / CONFIG_FILE, _to_json(config))

    def log_round(self, server_round: int, metrics: Mapping[str, float | int]) -> None:
        """Record one round and rewrite ``metrics.json`` and ``metrics.csv``."""
        row = self._rounds.setdefault(int(server_round), {"round": int(server_round)})
        row.update((k, v) for k, v in metrics.items() if k != "round")
        self._write_rounds()

    def _write_rounds(self) -> None:
        rows = self.rounds
        write_atomic(self.run_dir / METRICS_JSON, _to_json(rows))
        write_atomic(self.run_dir / METRICS_CSV, _to_csv(rows, _union_keys(rows)))

    def log_clients(self, server_round: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Record per-client rows of one round in ``clients.csv``."""
        new_rows = [_with_round(server_round, row) for row in rows]
        if not new_rows:
            return
        self._client_rows.extend(new_rows)
        columns = _union_keys(new_rows, start=self._client_columns)
        path = self.run_dir / CLIENTS_CSV
        if columns == self._client_columns:
            with path.open("a", newline="", encoding="utf-8") as fh:
                fh.write(_to_csv(new_rows, columns, header=False))
        else:
            # A CSV header cannot grow in place: rewrite everything. This is
            # also the path of the first call, which replaces any stale file.
            write_atomic(path, _to_csv(self._client_rows, columns))
            self._client_columns = columns

    def checkpoint(self) -> dict[str, Any]:
        """Return the rows written so far (a resumed run starts from exactly these)."""
        return {"rounds": self.rounds, "client_rows": self.client_rows}

    def restore(self, saved: Mapping[str, Any]) -> None:
        """Continue from :meth:`checkpoint`'s rows, rewriting the files from them.

        Rows a crashed run wrote after its last checkpoint are dropped: that
        round runs again, and would otherwise appear twice.
        """
        self._rounds = {int(r["round"]): dict(r) for r in saved["rounds"]}
        self._client_rows = [dict(r) for r in saved["client_rows"]]
        self._client_columns = _union_keys(self._client_rows)
        self._write_rounds()
        write_atomic(self.run_dir / CLIENTS_CSV,
                      _to_csv(self._client_rows, self._client_columns))

    def close(self) -> None:
        """Write ``metrics.png`` and ``clients.png`` if there is data (and ``plots``).

        Plots are skipped with a warning when matplotlib is not installed.
        Calling it again is a no-op.
        """
        if self._closed:
            return
        self._closed = True
        if not self.plots:
            return
        title = self.run_dir.resolve().name
        try:
            if self._rounds:
                plot_round_metrics(self.rounds, self.run_dir / METRICS_PNG, title=title)
                plot_accuracy_vs_time(self.rounds, self.run_dir / TIME_PNG, title=title)
            if self._client_rows:
                plot_client_metrics(self._client_rows, self.run_dir / CLIENTS_PNG, title=title)
                plot_client_time_breakdown(
                    self._client_rows, self.run_dir / CLIENT_TIME_PNG, title=title
                )
        except ImportError as err:
            _LOG.warning("no plots written (%s); the CSV/JSON files are complete", err)


def _with_round(server_round: int, row: Mapping[str, Any]) -> dict[str, Any]:
    return {"round": int(server_round)} | {k: v for k, v in row.items() if k != "round"}


def _union_keys(rows: Iterable[Mapping[str, Any]], start: Sequence[str] = ("round",)) -> list[str]:
    """Return ``start`` followed by unseen keys of ``rows`` in first-seen order."""
    columns = dict.fromkeys(start or ("round",))
    for row in rows:
        columns.update(dict.fromkeys(row))
    return list(columns)


def _to_csv(
    rows: Iterable[Mapping[str, Any]], columns: Sequence[str], *, header: bool = True
) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), restval="")
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def _to_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=_json_default) + "\n"


def _json_default(obj: Any) -> Any:
    """Convert what ``json`` cannot: mappings, numpy/torch scalars, paths."""
    if isinstance(obj, Mapping):
        return dict(obj)
    if isinstance(obj, set | frozenset):
        return sorted(obj, key=str)
    if hasattr(obj, "item") and getattr(obj, "ndim", 0) == 0:
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


