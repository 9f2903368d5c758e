"""Tests for :mod:`splitlearn.tracking` (file sink, fan-out, W&B offline)."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from splitlearn.tracking import (
    CompositeSink,
    FileSink,
    MetricsSink,
    WandbSink,
    has_credentials,
    make_sinks,
    plot_client_metrics,
    plot_round_metrics,
    resolve_mode,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

ROUNDS = [
    {"test_accuracy": 0.41, "test_loss": 1.7, "train_loss": 1.9, "examples": 600},
    {"test_accuracy": 0.63, "test_loss": 1.1, "train_loss": 1.2, "examples": 600},
    {"test_accuracy": 0.71, "test_loss": 0.9, "train_loss": 0.8, "examples": 600},
]


def _client_rows(n: int = 3, **extra: Any) -> list[dict[str, Any]]:
    return [
        {
            "client": c,
            "examples": 200,
            "bytes_up": 1000 * (c + 1),
            "bytes_down": 500 * (c + 1),
            "compute_s": 0.1 * (c + 1),
        }
        | extra
        for c in range(n)
    ]


def _read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


def _assert_png(path: Path) -> None:
    assert path.is_file()
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 1000


@pytest.fixture
def no_wandb_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point HOME at an empty folder and clear every W&B variable."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    return home


class RecordingSink:
    """Sink that records calls and can be told to fail."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_on = fail_on

    def _record(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))
        if name == self.fail_on:
            raise RuntimeError(f"{name} failed")

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the call."""
        self._record("log_config", config)

    def log_round(self, server_round: int, metrics: Mapping[str, float | int]) -> None:
        """Record the call."""
        self._record("log_round", server_round, metrics)

    def log_clients(self, server_round: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Record the call."""
        self._record("log_clients", server_round, rows)

    def close(self) -> None:
        """Record the call."""
        self._record("close")


# --------------------------------------------------------------------- FileSink


def test_file_sink_config_round_trips(tmp_path: Path) -> None:
    """config.json holds the nested config exactly."""
    config = {"model": {"name": "cnn", "cut": 2}, "lr": 0.01, "tags": ["a", "b"]}
    sink = FileSink(tmp_path / "run")
    sink.log_config(config)
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == config


def test_file_sink_writes_metrics_after_every_round(tmp_path: Path) -> None:
    """metrics.json/csv exist after each round, before close()."""
    sink = FileSink(tmp_path)
    for r, metrics in enumerate(ROUNDS, start=1):
        sink.log_round(r, metrics)
        assert len(json.loads((tmp_path / "metrics.json").read_text())) == r
    assert json.loads((tmp_path / "metrics.json").read_text()) == [
        {"round": r, **m} for r, m in enumerate(ROUNDS, start=1)
    ]
    header, rows = _read_csv(tmp_path / "metrics.csv")
    assert header == ["round", "test_accuracy", "test_loss", "train_loss", "examples"]
    assert [float(row["test_accuracy"]) for row in rows] == [0.41, 0.63, 0.71]
    assert [int(row["round"]) for row in rows] == [1, 2, 3]


def test_file_sink_merges_calls_for_the_same_round(tmp_path: Path) -> None:
    """Fit then evaluate metrics of one round end up in one row."""
    sink = FileSink(tmp_path)
    sink.log_round(1, {"train_loss": 1.0})
    sink.log_round(1, {"test_accuracy": 0.5})
    sink.log_round(2, {"test_accuracy": 0.6})
    header, rows = _read_csv(tmp_path / "metrics.csv")
    assert header == ["round", "train_loss", "test_accuracy"]
    assert rows == [
        {"round": "1", "train_loss": "1.0", "test_accuracy": "0.5"},
        {"round": "2", "train_loss": "", "test_accuracy": "0.6"},
    ]


def test_file_sink_clients_csv_widens_header(tmp_path: Path) -> None:
    """A key first seen in round 2 rewrites clients.csv with the union header."""
    sink = FileSink(tmp_path)
    sink.log_clients(1, _client_rows(2))
    header, rows = _read_csv(tmp_path / "clients.csv")
    assert header[0] == "round" and "cut" not in header
    assert len(rows) == 2

    sink.log_clients(2, _client_rows(2, cut=3))
    sink.log_clients(3, _client_rows(2, cut=1))  # same header: appended
    header, rows = _read_csv(tmp_path / "clients.csv")
    assert header == [
        "round",
        "client",
        "examples",
        "bytes_up",
        "bytes_down",
        "compute_s",
        "cut",
    ]
    assert [row["round"] for row in rows] == ["1", "1", "2", "2", "3", "3"]
    assert [row["cut"] for row in rows] == ["", "", "3", "3", "1", "1"]
    assert rows[3]["bytes_up"] == "2000"


def test_file_sink_close_writes_pngs(tmp_path: Path) -> None:
    """close() leaves two valid, non-empty PNGs."""
    sink = FileSink(tmp_path)
    for r, metrics in enumerate(ROUNDS, start=1):
        sink.log_round(r, metrics)
        sink.log_clients(r, _client_rows(cut=2))
    sink.close()
    _assert_png(tmp_path / "metrics.png")
    _assert_png(tmp_path / "clients.png")


def test_without_plots_the_files_are_complete_and_no_png_is_drawn(tmp_path: Path) -> None:
    """``logger.plots=false``: the same JSON and CSV files, no PNG."""
    for folder, plots in ((tmp_path / "with", True), (tmp_path / "without", False)):
        sink = make_sinks(run_dir=folder, logger="none", plots=plots)
        for r, metrics in enumerate(ROUNDS, start=1):
            sink.log_round(r, metrics)
            sink.log_clients(r, _client_rows(cut=2))
        sink.close()
    assert not list((tmp_path / "without").glob("*.png"))
    assert {"metrics.png", "clients.png"} <= {p.name for p in (tmp_path / "with").glob("*.png")}
    for name in ("metrics.json", "metrics.csv", "clients.csv"):
        assert (tmp_path / "without" / name).read_bytes() == (tmp_path / "with" / name).read_bytes()


def test_file_sink_close_without_data_writes_no_png(tmp_path: Path) -> None:
    """A run that logged nothing gets no empty plots."""
    sink = FileSink(tmp_path)
    sink.close()
    sink.close()
    assert not list(tmp_path.glob("*.png"))


def test_plot_functions_return_none_without_data(tmp_path: Path) -> None:
    """Nothing to plot means no file and ``None``."""
    assert plot_round_metrics([], tmp_path / "a.png") is None
    assert plot_round_metrics([{"round": 1, "examples": 5}], tmp_path / "b.png") is None
    assert plot_client_metrics([], tmp_path / "c.png") is None
    assert plot_client_metrics([{"round": 1, "client": 0}], tmp_path / "d.png") is None
    assert not list(tmp_path.iterdir())


def test_plot_functions_handle_partial_data(tmp_path: Path) -> None:
    """Loss-only rounds and clients without bytes still give a plot."""
    path = plot_round_metrics([{"round": 0, "test_loss": 2.3}], tmp_path / "r.png")
    assert path == tmp_path / "r.png"
    _assert_png(path)
    rows = [{"round": 1, "client": "a", "compute_s": 1.0}]
    _assert_png(plot_client_metrics(rows, tmp_path / "c.png"))


# ---------------------------------------------------------------- CompositeSink


def test_composite_sink_fans_out_in_order(tmp_path: Path) -> None:
    """Every sink gets every call; FileSink satisfies the protocol."""
    first, second = RecordingSink(), RecordingSink()
    sink = CompositeSink([first, second])
    sink.log_config({"a": 1})
    sink.log_round(1, {"test_accuracy": 0.5})
    sink.log_clients(1, [{"client": 0}])
    sink.close()
    sink.close()  # second close is a no-op
    for recorder in (first, second):
        assert [name for name, _ in recorder.calls] == [
            "log_config",
            "log_round",
            "log_clients",
            "close",
        ]
    assert isinstance(FileSink(tmp_path), MetricsSink)


def test_composite_sink_closes_all_and_reraises_first() -> None:
    """A failing close() does not stop later sinks; its error comes out."""
    sinks = [RecordingSink(fail_on="close"), RecordingSink(), RecordingSink("close")]
    with pytest.raises(RuntimeError, match="close failed") as info:
        CompositeSink(sinks).close()
    assert all(s.calls == [("close", ())] for s in sinks)
    assert info.value.__traceback__ is not None


def test_composite_sink_context_manager_closes() -> None:
    """``with`` closes the sinks on the way out."""
    recorder = RecordingSink()
    with CompositeSink([recorder]) as sink:
        sink.log_round(1, {"x": 1})
    assert recorder.calls[-1] == ("close", ())


# -------------------------------------------------------------------- make_sinks


def test_make_sinks_none_is_files_only(tmp_path: Path) -> None:
    """logger='none' gives exactly one FileSink."""
    sink = make_sinks(run_dir=tmp_path / "run", logger="none")
    assert [type(s) for s in sink.sinks] == [FileSink]
    sink.close()


def test_make_sinks_rejects_unknown_logger(tmp_path: Path) -> None:
    """The error names the bad value and the accepted ones, and creates nothing."""
    with pytest.raises(ValueError, match="'tensorboard'") as info:
        make_sinks(run_dir=tmp_path / "run", logger="tensorboard")
    assert "'wandb'" in str(info.value) and "'none'" in str(info.value)
    assert not (tmp_path / "run").exists()


def test_make_sinks_wandb_adds_wandb_sink(tmp_path: Path, no_wandb_credentials: Path) -> None:
    """logger='wandb' gives FileSink then WandbSink; PNGs are closed first."""
    run_dir = tmp_path / "run"
    sink = make_sinks(run_dir=run_dir, logger="wandb", group="g", tags=("t1",), run_name="r")
    assert [type(s) for s in sink.sinks] == [FileSink, WandbSink]
    assert sink.sinks[1].mode == "offline"
    sink.log_config({"model": {"cut": 2}})
    for r, metrics in enumerate(ROUNDS, start=1):
        sink.log_round(r, metrics)
        sink.log_clients(r, _client_rows(cut=r))
    sink.close()
    _assert_png(run_dir / "metrics.png")
    assert list((run_dir / "wandb").glob("offline-run-*/files/media/images/**/*.png"))


# -------------------------------------------------------------------- WandbSink


def _offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


@pytest.mark.parametrize("mode", ["offline", "auto"])
def test_wandb_sink_offline_writes_run_folder(
    tmp_path: Path, no_wandb_credentials: Path, mode: str
) -> None:
    """Offline (explicit, or auto without credentials) makes a local run."""
    run_dir = tmp_path / "run"
    sink = WandbSink(run_dir=run_dir, project="test", group=None, tags=(), run_name=None, mode=mode)
    assert sink.mode == "offline"
    sink.log_config({"a": {"b": 1}})
    sink.log_round(1, {"test_accuracy": 0.5})
    sink.log_clients(1, [{"client": 0, "cut": 1}, {"client": "x", "bytes_up": 3}])
    sink.close()
    sink.close()
    (offline_run,) = _offline_runs(run_dir)
    wandb_files = list(offline_run.glob("*.wandb"))
    assert len(wandb_files) == 1 and wandb_files[0].stat().st_size > 0


def test_wandb_sink_disabled_writes_nothing(tmp_path: Path, no_wandb_credentials: Path) -> None:
    """mode='disabled' accepts every call and writes no run."""
    sink = WandbSink(
        run_dir=tmp_path,
        project="test",
        group=None,
        tags=(),
        run_name=None,
        mode="disabled",
    )
    sink.log_round(1, {"x": 1.0})
    sink.close()
    assert not _offline_runs(tmp_path)


def test_wandb_sink_rejects_unknown_mode(tmp_path: Path) -> None:
    """A bad mode fails before wandb starts."""
    with pytest.raises(ValueError, match="'cloud'"):
        WandbSink(
            run_dir=tmp_path,
            project="p",
            group=None,
            tags=(),
            run_name=None,
            mode="cloud",
        )


# ----------------------------------------------------------------- resolve_mode


@pytest.fixture
def w_and_b_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A HOME without credentials, and no W&B variables: what a fresh machine has."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "NETRC",
                 "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    return home


def test_resolve_mode_auto_follows_api_key(w_and_b_env: Path, monkeypatch) -> None:
    """API key set: online; unset or empty: offline."""
    assert resolve_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert resolve_mode("auto") == "online"
    monkeypatch.setenv("WANDB_API_KEY", "")
    assert resolve_mode("auto") == "offline"


def test_resolve_mode_auto_reads_what_wandb_login_writes(w_and_b_env: Path, monkeypatch) -> None:
    """A netrc entry for W&B's host counts; one for another host does not."""
    netrc = w_and_b_env / ".netrc"
    netrc.write_text("machine example.com login u password p\n")
    netrc.chmod(0o600)
    assert not has_credentials()
    netrc.write_text(f"machine api.wandb.ai login user password {'k' * 40}\n")
    assert has_credentials() and resolve_mode("auto") == "online"
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")  # an on-prem server
    assert resolve_mode("auto") == "offline"


def test_resolve_mode_auto_tolerates_broken_credentials(w_and_b_env: Path, monkeypatch) -> None:
    """An unparsable netrc or a malformed key means 'offline', not a crash."""
    (w_and_b_env / ".netrc").write_text("machine\n")
    assert resolve_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "short")
    assert resolve_mode("auto") == "offline"


def test_resolve_mode_explicit_and_env_override(w_and_b_env: Path, monkeypatch) -> None:
    """Explicit modes pass through; WANDB_MODE steers 'auto'."""
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    for mode in ("online", "offline", "disabled"):
        assert resolve_mode(mode) == mode
    for value, expected in (("offline", "offline"), ("dryrun", "offline"), ("bogus", "online")):
        monkeypatch.setenv("WANDB_MODE", value)
        assert resolve_mode("auto") == expected
    with pytest.raises(ValueError, match="'cloud'"):
        resolve_mode("cloud")
