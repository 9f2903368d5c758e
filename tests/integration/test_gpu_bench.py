"""The accelerator check's serving part, rehearsed on the CPU: real gRPC, real processes."""

from __future__ import annotations

from benchmarks.gpu import serve_once


def test_the_trunk_serves_synthetic_devices_and_times_every_batch():
    row = serve_once("cpu", devices=2, batching=True, precision="bf16", cut=5, processes=2,
                     seconds=1.0, warmup_s=0.5, batch=8)
    assert row["errors"] == 0 and row["batches"] >= 2
    assert 0 < row["p50_ms"] <= row["p95_ms"]
