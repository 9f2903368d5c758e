"""The peer's job (benchmarks/peer/export_job.py) is exactly what the default job trains on."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from clients.app import ClientRound
from protocols import compose_config, protocol_named
from splitlearn.config import run_spec, to_object
from splitlearn.data import held_out_dataset
from splitlearn.models.factory import build_model_from_config

EXPORT = Path(__file__).parents[2] / "benchmarks" / "peer" / "export_job.py"


def load_export():  # noqa: ANN201 - the script's module
    spec = importlib.util.spec_from_file_location("peer_export_job", EXPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_exported_job_is_the_default_jobs_partitions_test_split_and_weights(tmp_path):
    path = tmp_path / "job.pt"
    load_export().export(str(path))
    job = torch.load(path, weights_only=False)
    cfg = compose_config(["logger=none"])
    dataset = to_object(cfg.dataset)
    assert len(job["parts"]) == cfg.num_clients
    spec = run_spec(cfg, host_flops_per_s=0.0)
    for partition, (images, labels) in enumerate(job["parts"]):
        # What a ClientApp of the default job trains on for that partition.
        task = ClientRound(protocol_named(cfg.strategy.name), spec, server_round=1,
                           cut=cfg.model.cut, recompute=False, token="", trunk_address="",
                           partition_id=partition, num_partitions=cfg.num_clients)
        built = task.dataset().tensors
        assert torch.equal(images, built[0]) and torch.equal(labels, built[1])
    test_images, test_labels = held_out_dataset(dataset, seed=cfg.seed).tensors
    assert torch.equal(job["test"][0], test_images) and torch.equal(job["test"][1], test_labels)
    model = build_model_from_config(to_object(cfg.model), dataset, seed=cfg.seed)
    assert job["state"].keys() == model.state_dict().keys()
    assert all(torch.equal(job["state"][k], v) for k, v in model.state_dict().items())

