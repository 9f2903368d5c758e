"""Run tracking: metrics sinks for files and Weights & Biases, and plots.

Typical server-side use::

    sink = make_sinks(run_dir=run_dir, logger="wandb", group="cifar-cuts")
    with sink:
        sink.log_config(resolved_config)
        sink.log_round(1, {"test_accuracy": 0.61, "test_loss": 1.1})
        sink.log_clients(1, [{"client": 0, "bytes_up": 1024, "compute_s": 0.4}])
"""

from __future__ import annotations

from splitlearn.tracking.files import FileSink
from splitlearn.tracking.plots import plot_client_metrics, plot_round_metrics
from splitlearn.tracking.sink import LOGGERS, CompositeSink, MetricsSink, make_sinks
from splitlearn.tracking.wandb_sink import (
    MODES,
    WandbSink,
    has_credentials,
    resolve_mode,
)

__all__ = [
    "LOGGERS",
    "MODES",
    "CompositeSink",
    "FileSink",
    "MetricsSink",
    "WandbSink",
    "has_credentials",
    "make_sinks",
    "plot_client_metrics",
    "plot_round_metrics",
    "resolve_mode",
]
