"""The same SplitFed math in one process, with the in-process transport.

No Flower, no gRPC: clients run in threads (``concurrency`` at a time, as the
Simulation Engine runs one ClientApp per core) against the shared trunk through
:class:`~splitlearn.transport.InProcessTrunkSession` (same frames, same checks),
and client sides are averaged by examples. It is the "limit" that the
``overhead`` benchmark compares the real deployment path against.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from clients.train import run_split_round
from server.app import build_endpoint, make_task_template
from splitlearn.data import load_test_data
from splitlearn.evaluation import evaluate_model
from splitlearn.models import SplittableModel
from splitlearn.privacy import (
    PrivacyAccountant,
    PrivacyBudgetExhausted,
    PrivacySettings,
    with_release_at_cut,
)
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


def run_in_process(
    cfg: DictConfig,
    *,
    concurrency: int = 1,
    on_round: Callable[[int, SplittableModel], None] | None = None,
) -> list[dict[str, float]]:
    """Run ``cfg.strategy.num_rounds`` SplitFed rounds over all clients, in process.

    Parameters
    ----------
    cfg : DictConfig
        The experiment config.
    concurrency : int
        Clients training at the same time (threads; torch releases the GIL).
    on_round : Callable[[int, SplittableModel], None], optional
        Called after each round with the round and the joined model (averaged
        client side + trunk), e.g. to keep the final model for attacks.

    Returns
    -------
    list[dict[str, float]]
        Per round: ``round``, ``examples``, ``round_train_s`` (training only),
        ``test_accuracy``, ``test_loss``; with privacy on also ``epsilon`` (the
        largest over clients) and ``clients_budget`` (clients out of budget).
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
    privacy = PrivacySettings.from_config(cfg.privacy)
    accountants = [PrivacyAccountant() for _ in range(cfg.num_clients)]

    def train_client(server_round: int, pid: int) -> tuple[dict | None, float]:
        token = endpoint.tokens.issue(
            client=str(pid), cut=cut, server_round=server_round, ttl_s=3600
        )
        task = replace(template, server_round=server_round, token=token)
        try:
            new_state, report = run_split_round(
                task, state, endpoint.local_session(token),
                partition_id=pid, num_partitions=cfg.num_clients, accountant=accountants[pid],
            )
        except PrivacyBudgetExhausted:
            return None, 0
        return new_state, report.examples

    history = []
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for server_round in range(1, cfg.strategy.num_rounds + 1):
            started = time.perf_counter()
            results = list(pool.map(
                lambda pid, r=server_round: train_client(r, pid), range(cfg.num_clients)
            ))
            train_s = time.perf_counter() - started
            endpoint.tokens.revoke_round(server_round)
            trained = [(s, examples) for s, examples in results if s is not None]
            weights = [examples for _, examples in trained]
            if trained:  # every client out of privacy budget: keep the weights
                state = average_states([s for s, _ in trained], weights)
            joined = endpoint.trunk.snapshot()
            load_bottom_state(joined, state)
            deployed = with_release_at_cut(joined, cut=cut, settings=privacy)
            loss, accuracy, _ = evaluate_model(deployed, test)
            row = {
                "round": server_round, "examples": float(sum(weights)),
                "round_train_s": train_s, "test_accuracy": accuracy, "test_loss": loss,
            }
            if privacy.accounted:
                row["epsilon"] = max(a.epsilon(privacy.delta) for a in accountants)
                row["clients_budget"] = float(len(results) - len(trained))
            history.append(row)
            if on_round is not None:
                on_round(server_round, joined)
    return history
