"""The ClientApp keeps its privacy accountant in ``context.state`` and declines past its budget."""

from __future__ import annotations

import pytest

from clients.app import ACCOUNTANT_STATE_KEY, build_client_app
from experiments.local import LocalGrid, in_process_channels
from server.app import run_training, start_runtime, stop_runtime
from splitlearn.privacy import compute_epsilon
from tests.conftest import small_config


def test_epsilon_accumulates_in_context_state_until_the_budget_stops_training(tmp_path):
    sigma = 0.5
    one_round = compute_epsilon(history=[(sigma / 2, 1.0, 1)], delta=1e-5)
    two_rounds = compute_epsilon(history=[(sigma / 2, 1.0, 2)], delta=1e-5)
    cfg = small_config(
        "strategy.num_rounds=3", "privacy=activation_gaussian", f"privacy.noise_multiplier={sigma}",
        "privacy.clip_norm=5", f"privacy.epsilon_max={(one_round + two_rounds) / 2}",
        run_dir=str(tmp_path),
    )
    runtime = start_runtime(cfg)
    try:
        grid = LocalGrid(build_client_app(in_process_channels(runtime.endpoint)),
                         num_nodes=cfg.num_clients)
        history = run_training(grid, runtime).history
    finally:
        stop_runtime(runtime)
    by_round = {r["round"]: r for r in history}
    # Round 1 trains everyone and costs one release per example; round 2 would pass the
    # budget, so every client declines; round 3 samples nobody (the guard remembers).
    assert by_round[1]["examples"] > 0 and by_round[1]["clients_budget"] == 0
    assert by_round[1]["epsilon"] == pytest.approx(one_round)
    assert by_round[2]["examples"] == 0 and by_round[2]["clients_budget"] == cfg.num_clients
    assert by_round[3]["examples"] == 0
    assert by_round[3]["epsilon"] == pytest.approx(one_round)  # never charged past round 1
    for context in grid.contexts.values():
        # The spend persisted in each node's state: one accounted epoch, nothing more.
        assert list(context.state[ACCOUNTANT_STATE_KEY]["num-steps"]) == [1]
