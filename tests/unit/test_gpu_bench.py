"""The prepared accelerator check refuses what it cannot run, and reports what it ran."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu import bench_gpu, summary_markdown


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_the_check_refuses_a_device_this_machine_lacks_before_it_runs(tmp_path):
    with pytest.raises(ValueError, match="server.device=cuda: this machine has no CUDA"):
        bench_gpu([], device="cuda", out_dir=tmp_path)
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_the_check_takes_no_overrides(tmp_path):
    with pytest.raises(ValueError, match="takes no Hydra overrides"):
        bench_gpu(["model=resnet"], device="cpu", out_dir=tmp_path)


def test_a_failed_part_is_reported_and_a_run_that_did_not_learn_gets_no_fraction():
    page = summary_markdown({
        "device": "cuda", "device_name": "Some GPU", "torch": "2.13.0", "quick": False,
        "parts": {
            "tests": {"summary": "2 passed"},
            "resnet18": {"central": {"samples_per_s": 1000.0, "test_accuracy": 0.9},
                         "split": [{"clients": 16, "samples_per_s": 850.0, "test_accuracy": 0.9,
                                    "fraction_of_central": 0.85},
                                   {"clients": 64, "samples_per_s": 900.0, "test_accuracy": 0.1,
                                    "not_learning": "accuracy below the floor 0.5"}],
                         "floor": 0.5},
            "serve": {"error": "RuntimeError: CUDA out of memory"},
        }})
    assert "Some GPU" in page and "| 16 | 850 | 0.900 | 0.85 |" in page
    assert "| 64 | 900 | 0.100 | accuracy below the floor 0.5 |" in page
    assert "- serve: RuntimeError: CUDA out of memory" in page
