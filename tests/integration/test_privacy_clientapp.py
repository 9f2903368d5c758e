"""The ClientApp keeps its privacy accountant in ``context.state`` and declines past its budget."""

from __future__ import annotations

from dataclasses import replace

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from clients.app import ACCOUNTANT_STATE_KEY, train_split
from server.app import make_task_template
from splitlearn.config import compose_config
from splitlearn.privacy import compute_epsilon
from splitlearn.privacy.budget import BUDGET_STATUS
from splitlearn.split import bottom_state
from splitlearn.task import STATUS_KEY
from splitlearn.wire import state_to_record
from tests.conftest import digits_like_model


@pytest.fixture(autouse=True)
def run_identity(monkeypatch):
    monkeypatch.setattr(TaskIdentity, "_run_id", 1, raising=False)
    monkeypatch.setattr(TaskIdentity, "_node_id", 1, raising=False)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1, raising=False)


def test_epsilon_accumulates_in_context_state_until_the_budget_stops_training(
    trunk_server_factory,
):
    sigma = 0.5
    one_round = compute_epsilon(history=[(sigma / 2, 1.0, 1)], delta=1e-5)
    two_rounds = compute_epsilon(history=[(sigma / 2, 1.0, 2)], delta=1e-5)
    cfg = compose_config([
        "num_clients=5", "strategy.local_epochs=1", "privacy=activation_gaussian",
        f"privacy.noise_multiplier={sigma}", "privacy.clip_norm=5",
        f"privacy.epsilon_max={(one_round + two_rounds) / 2}",
    ])
    model = digits_like_model("cnn")
    server = trunk_server_factory(model, lr=cfg.strategy.lr)
    template = make_task_template(cfg, server.service.address)
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 5},
                      state=RecordDict(), run_config={})
    arrays = state_to_record(bottom_state(model, cfg.model.cut))

    def send(server_round: int) -> Message:
        task = replace(template, server_round=server_round,
                       token=server.token(cfg.model.cut, server_round=server_round))
        content = RecordDict({"arrays": arrays, "config": ConfigRecord(task.to_config())})
        msg = Message(content=content, dst_node_id=1, message_type="train.split")
        return train_split(msg, context)

    first = send(1)
    assert STATUS_KEY not in first.content.config_records
    assert first.content["metrics"]["epsilon"] == pytest.approx(one_round)
    assert first.content["metrics"]["num-examples"] > 0
    assert list(context.state[ACCOUNTANT_STATE_KEY]["num-steps"]) == [1]

    second = send(2)
    assert second.content[STATUS_KEY]["status"] == BUDGET_STATUS
    assert second.content["metrics"]["epsilon"] == pytest.approx(one_round)
    assert not second.content.array_records  # nothing trained, nothing to aggregate
    assert list(context.state[ACCOUNTANT_STATE_KEY]["num-steps"]) == [1]
