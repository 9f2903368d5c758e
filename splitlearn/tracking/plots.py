"""PNG plots of a run's metrics.

matplotlib is imported inside the plotting functions, and only
:class:`matplotlib.figure.Figure` is used (never ``pyplot``): no global
figure registry, no backend switch, safe in threads and headless processes.
PNG output goes through the Agg renderer either way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

_DPI = 120
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def plot_round_metrics(
    rounds: Sequence[Mapping[str, Any]], path: Path, *, title: str | None = None
) -> Path | None:
    """Plot accuracy and loss per round.

    One panel per group of keys that is present: keys containing ``"acc"``
    (accuracy) and keys containing ``"loss"``. The best value of the main
    accuracy curve (a ``test`` key if there is one) is marked.

    Parameters
    ----------
    rounds : Sequence[Mapping[str, Any]]
        Per-round rows, each with a ``"round"`` key.
    path : Path
        PNG file to write; its folder is created if missing.
    title : str | None
        Figure title, e.g. the run name.

    Returns
    -------
    Path | None
        ``path``, or ``None`` (nothing written) if no row has a numeric
        accuracy or loss value.
    """
    panels = [
        (name, keys)
        for name, needle in (("Accuracy", "acc"), ("Loss", "loss"))
        if (keys := _keys_with(rounds, needle))
    ]
    if not panels:
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5 * len(panels), 4.2), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, keys) in zip(axes, panels, strict=True):
        _draw_round_panel(ax, rounds, name, keys)
    fig.suptitle(_title("Training progress", title), fontweight="bold")
    return _save(fig, path)


def plot_client_metrics(
    rows: Sequence[Mapping[str, Any]], path: Path, *, title: str | None = None
) -> Path | None:
    """Bar-chart per-client traffic and compute time of the last round.

    Parameters
    ----------
    rows : Sequence[Mapping[str, Any]]
        Per-client rows with ``"client"`` and some of ``"bytes_up"``,
        ``"bytes_down"``, ``"compute_s"`` (and optionally ``"cut"``). If rows
        have a ``"round"`` key, only the highest round is plotted.
    path : Path
        PNG file to write; its folder is created if missing.
    title : str | None
        Figure title prefix, e.g. the run name.

    Returns
    -------
    Path | None
        ``path``, or ``None`` (nothing written) if there are no rows or none
        of the plotted keys has a numeric value.
    """
    last_round, last = _last_round(rows)
    has_bytes = bool(_keys_with(last, "bytes_up") or _keys_with(last, "bytes_down"))
    has_compute = bool(_keys_with(last, "compute_s"))
    if not (has_bytes or has_compute):
        return None
    from matplotlib.figure import Figure

    last = sorted(last, key=lambda row: _natural_key(row.get("client")))
    labels = [_client_label(row) for row in last]
    fig, axes = _client_figure(Figure, len(labels), int(has_bytes) + int(has_compute))
    if has_bytes:
        _draw_bytes_panel(axes.pop(0), last, labels)
    if has_compute:
        _draw_compute_panel(axes.pop(0), last, labels)
    when = "" if last_round is None else f", round {last_round}"
    fig.suptitle(_title(f"Per-client cost{when}", title), fontweight="bold")
    return _save(fig, path)


#: Causes of a client's virtual time, stacked bottom to top in the breakdown plot.
TIME_PARTS = (
    ("virtual_compute_s", "compute"),
    ("virtual_upload_s", "upload"),
    ("virtual_download_s", "download"),
    ("virtual_latency_s", "latency"),
)


def plot_accuracy_vs_time(
    rounds: Sequence[Mapping[str, Any]], path: Path, *, title: str | None = None
) -> Path | None:
    """Plot test accuracy against virtual device time and against wall time.

    Returns None (nothing written) when the rows carry no ``virtual_time_s``.
    """
    points = [
        (_number(r.get("virtual_time_s")), _number(r.get("wall_s")),
         _number(r.get("test_accuracy")))
        for r in rounds
    ]
    points = [p for p in points if math.isfinite(p[0]) and math.isfinite(p[2])]
    if not points:
        return None
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    for ax, index, label in zip(
        fig.subplots(1, 2), (0, 1), ("Virtual time on the devices (s)", "Wall time here (s)"),
        strict=True,
    ):
        xs = [p[index] for p in points]
        ax.plot(xs, [p[2] for p in points], marker="o" if len(points) <= 40 else None,
                markersize=4, linewidth=1.8)
        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
        ax.set_xlabel(label)
        ax.set_ylabel("Test accuracy")
        ax.grid(True, alpha=0.3)
    fig.suptitle(_title("Accuracy over time", title), fontweight="bold")
    return _save(fig, path)


def plot_client_time_breakdown(
    rows: Sequence[Mapping[str, Any]], path: Path, *, title: str | None = None
) -> Path | None:
    """Stack each client's virtual time by cause (last round), labelled by profile.

    Clients that did not finish get no bar but keep their label with the cause.
    Returns None when the rows carry no virtual time.
    """
    last_round, last = _last_round(rows)
    if not _keys_with(last, "virtual_compute_s"):
        return None
    from matplotlib.figure import Figure

    last = sorted(last, key=lambda row: _natural_key(row.get("client")))
    labels = [
        f"{row.get('client', '?')}\n{row.get('profile', '')}"
        + ("" if row.get("status", "ok") == "ok" else f"\n({row['status']})")
        for row in last
    ]
    fig, axes = _client_figure(Figure, len(last), 1)
    ax = axes[0]
    bottom = [0.0] * len(last)
    for key, name in TIME_PARTS:
        heights = [_number(row.get(key)) for row in last]
        heights = [h if math.isfinite(h) else 0.0 for h in heights]
        ax.bar(range(len(last)), heights, 0.6, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    _client_axis(ax, labels)
    ax.set_ylabel("Virtual seconds")
    ax.legend(loc="upper left", ncols=2, frameon=False)
    ax.set_ylim(top=max(bottom, default=1.0) * 1.3 or 1.0)
    when = "" if last_round is None else f", round {last_round}"
    fig.suptitle(_title(f"Where each client's time goes{when}", title), fontweight="bold")
    return _save(fig, path)


def _client_figure(figure_cls: Any, n_clients: int, panels: int) -> tuple[Any, list[Axes]]:
    """Make a figure whose bars stay readable for 2 or 200 clients."""
    width = min(20.0, max(5.5, 0.32 * n_clients + 2.0))
    # Few clients: panels side by side. Many: stacked, each the full width.
    stacked = n_clients > 12 and panels > 1
    rows, cols = (panels, 1) if stacked else (1, panels)
    fig = figure_cls(figsize=(width * cols, 4.4 * rows), layout="constrained")
    return fig, list(fig.subplots(rows, cols, squeeze=False).ravel())


def _draw_round_panel(
    ax: Axes, rounds: Sequence[Mapping[str, Any]], name: str, keys: list[str]
) -> None:
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    # Markers help with a handful of rounds and only clutter long runs.
    marker = "o" if len(rounds) <= 40 else None
    all_ys: list[float] = []
    for key in keys:
        xs, ys = _series(rounds, key)
        ax.plot(xs, ys, marker=marker, markersize=4, linewidth=1.8, label=_pretty(key))
        all_ys.extend(y for y in ys if math.isfinite(y))
    if name == "Accuracy":
        # Fractions in [0, 1] read better as percentages.
        if all_ys and 0.0 <= min(all_ys) and max(all_ys) <= 1.0:
            ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
        _mark_best(ax, rounds, _main_key(keys))
    ax.set_title(f"{name} per round")
    ax.set_xlabel("Round")
    ax.set_ylabel(name)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", frameon=False)


def _mark_best(ax: Axes, rounds: Sequence[Mapping[str, Any]], key: str) -> None:
    points = [(x, y) for x, y in zip(*_series(rounds, key), strict=True) if math.isfinite(y)]
    if not points:
        return
    x, y = max(points, key=lambda p: p[1])
    value = f"{y:.1%}" if 0.0 <= y <= 1.0 else f"{y:.3g}"
    # The legend, not an in-plot label, carries the text: it never hides the curve.
    ax.scatter(
        [x],
        [y],
        s=110,
        marker="*",
        color="gold",
        edgecolor="black",
        zorder=5,
        label=f"best {value} @ round {x:g}",
    )


def _draw_bytes_panel(ax: Axes, rows: Sequence[Mapping[str, Any]], labels: list[str]) -> None:
    up = [_number(row.get("bytes_up")) for row in rows]
    down = [_number(row.get("bytes_down")) for row in rows]
    scale, unit = _byte_unit(max((v for v in up + down if math.isfinite(v)), default=0.0))
    xs = range(len(rows))
    bar_w = 0.4
    ax.bar(
        [x - bar_w / 2 for x in xs],
        [v / scale for v in up],
        bar_w,
        label="up (client → server)",
    )
    ax.bar(
        [x + bar_w / 2 for x in xs],
        [v / scale for v in down],
        bar_w,
        label="down (server → client)",
    )
    _client_axis(ax, labels)
    ax.set_title("Traffic per client")
    ax.set_ylabel(f"Bytes ({unit})")
    # Headroom above the tallest bar keeps the legend off the bars.
    ax.set_ylim(top=ax.get_ylim()[1] * 1.18)
    ax.legend(loc="upper left", ncols=2, frameon=False)


def _draw_compute_panel(ax: Axes, rows: Sequence[Mapping[str, Any]], labels: list[str]) -> None:
    seconds = [_number(row.get("compute_s")) for row in rows]
    bars = ax.bar(range(len(rows)), seconds, 0.6, color="tab:green")
    if len(rows) <= 16:
        ax.bar_label(bars, fmt="%.3g", fontsize=8, padding=2)
    _client_axis(ax, labels)
    ax.set_title("Client compute time")
    ax.set_ylabel("Seconds")


def _client_axis(ax: Axes, labels: list[str]) -> None:
    # Long ids (Flower node ids are 19-digit ints) or many clients collide.
    longest = max((len(line) for s in labels for line in s.split("\n")), default=0)
    crowded = len(labels) > 12 or longest > 8
    ax.set_xticks(range(len(labels)), labels, rotation=90 if crowded else 0, fontsize=8)
    ax.set_xlabel("Client")
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI, format="png")
    return path


def _last_round(
    rows: Sequence[Mapping[str, Any]],
) -> tuple[int | None, list[Mapping[str, Any]]]:
    rounds = [row["round"] for row in rows if "round" in row]
    if not rounds:
        return None, list(rows)
    last = max(rounds)
    return last, [row for row in rows if row.get("round") == last]


def _keys_with(rows: Sequence[Mapping[str, Any]], needle: str) -> list[str]:
    """Return keys containing ``needle`` with a numeric value, first-seen order."""
    found: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if needle in key.lower() and not math.isnan(_number(value)):
                found[key] = None
    return list(found)


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    points = [(_number(row.get("round")), _number(row.get(key))) for row in rows if key in row]
    points = [(x, y) for x, y in points if not math.isnan(x)]
    return [x for x, _ in points], [y for _, y in points]


def _number(value: Any) -> float:
    """Return ``value`` as a float, NaN if it is missing or not a number."""
    if value is None or isinstance(value, str | bytes | bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _main_key(keys: list[str]) -> str:
    return next((key for key in keys if "test" in key.lower()), keys[0])


def _pretty(key: str) -> str:
    return key.replace("_", " ")


def _title(what: str, title: str | None) -> str:
    return f"{title}: {what}" if title else what


def _client_label(row: Mapping[str, Any]) -> str:
    label = str(row.get("client", "?"))
    return f"{label}\ncut {row['cut']}" if row.get("cut") is not None else label


def _natural_key(client: Any) -> tuple[int, float, str]:
    """Sort numeric ids numerically (2 before 10), then the rest by text."""
    text = str(client)
    number = _number(client) if not isinstance(client, str) else math.nan
    if math.isnan(number) and text.isdigit():
        number = float(text)
    return (1, 0.0, text) if math.isnan(number) else (0, number, text)


def _byte_unit(largest: float) -> tuple[float, str]:
    """Return the binary unit that keeps ``largest`` below 1024, and its size."""
    exponent = 0
    while largest >= 1024.0 and exponent < len(_BYTE_UNITS) - 1:
        largest /= 1024.0
        exponent += 1
    return 1024.0**exponent, _BYTE_UNITS[exponent]
