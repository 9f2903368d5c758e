"""The same SplitFed math in one process, with the in-process transport.

No Flower, no gRPC: clients run one after another against the shared trunk
through :class:`~splitlearn.transport.InProcessTrunkSession` (same frames, same
checks), and client sides are averaged by examples. It is the "limit" that the
``overhead`` benchmark compares the real deployment path against.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from clients.train import run_split_round
from server.app import build_endpoint, make_task_template
from splitlearn.data import load_test_data
from splitlearn.evaluation import evaluate_model
from splitlearn.split import bottom_state, load_bottom_state


def average_states(
    states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
) -> dict[str, torch.Tensor]:
    """Weighted average of state dicts (FedAvg), keeping each tensor's dtype."""
    total = float(sum(weights))
    return {
        key: sum(s[key].double() * (w / total) for s, w in zip(states, weights, strict=True))
        .to(states[0][key].dtype)
        for key in states[0]
    }


def run_in_process(cfg: DictConfig) -> list[dict[str, float]]:
    """Run ``cfg.strategy.num_rounds`` SplitFed rounds over all clients, in process.

    Returns
    -------
    list[dict[str, float]]
        Per round: ``round``, ``examples``, ``round_train_s`` (training only),
        ``test_accuracy``, ``test_loss``.
    """
    endpoint = build_endpoint(cfg)
    model, cut = endpoint.trunk.model, cfg.model.cut
    template = make_task_template(cfg, trunk_address="in-process")
    test = DataLoader(
        load_test_data(
            dataset=cfg.dataset.name, seed=cfg.seed, path=cfg.dataset.path,
            test_fraction=cfg.dataset.test_fraction, image_size=cfg.dataset.image_size,
        ),
        batch_size=512,
    )
    state = bottom_state(model, cut)
    history = []
    for server_round in range(1, cfg.strategy.num_rounds + 1):
        started = time.perf_counter()
        states, weights = [], []
        for pid in range(cfg.num_clients):
            token = endpoint.tokens.issue(
                client=str(pid), cut=cut, server_round=server_round, ttl_s=3600
            )
            task = replace(template, server_round=server_round, token=token)
            new_state, report = run_split_round(
                task, state, endpoint.local_session(token),
                partition_id=pid, num_partitions=cfg.num_clients,
            )
            states.append(new_state)
            weights.append(report.examples)
        train_s = time.perf_counter() - started
        endpoint.tokens.revoke_round(server_round)
        state = average_states(states, weights)
        joined = endpoint.trunk.snapshot()
        load_bottom_state(joined, state)
        loss, accuracy, _ = evaluate_model(joined, test)
        history.append({
            "round": server_round, "examples": float(sum(weights)), "round_train_s": train_s,
            "test_accuracy": accuracy, "test_loss": loss,
        })
    return history
