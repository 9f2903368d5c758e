"""A ServerApp that dies mid-run resumes from its last checkpoint: nothing lost, nothing twice.

The reference is the same run never interrupted: with one client at a time the
shipped apps repeat exactly, so the resumed run must end with the same weights,
to the bit, and the same rounds.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from clients.app import build_client_app
from experiments.local import LocalGrid, in_process_channels, run_local
from server.app import run_training, start_runtime, stop_runtime
from server.checkpoint import CHECKPOINT_FILE, load_checkpoint
from splitlearn.config import to_container
from splitlearn.messages import ROUND_KEY
from tests.conftest import small_config
from tests.integration.test_simulation import read_clients

ROUNDS = 4


class ServerCrash(RuntimeError):
    """The ServerApp process dies (raised inside its training loop)."""


class CrashingGrid(LocalGrid):
    """Delivers messages until the training round ``crash_at`` is sent, then 'dies'."""

    def __init__(self, *args, crash_at: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.crash_at = crash_at

    def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN201
        messages = list(messages)
        kind = messages[0].metadata.message_type if messages else ""
        if kind.startswith("train.") and messages[0].content[ROUND_KEY]["server_round"] == (
                self.crash_at):
            raise ServerCrash(f"killed as round {self.crash_at} was sent")
        return super().send_and_receive(messages, timeout=timeout)


def crash_then_resume(cfg, *, crash_at: int):
    """Run ``cfg`` until round ``crash_at`` is sent; then resume it in a new runtime."""
    runtime = start_runtime(cfg)
    try:
        grid = CrashingGrid(build_client_app(in_process_channels(runtime.endpoint)),
                            num_nodes=cfg.num_clients, crash_at=crash_at)
        with pytest.raises(ServerCrash):
            run_training(grid, runtime)
    finally:
        stop_runtime(runtime)
    saved = load_checkpoint(cfg.run_dir, config=to_container(cfg))
    assert saved.server_round == crash_at - 1
    resumed = cfg.copy()
    resumed.resume = True
    return saved, run_local(resumed)


def assert_same_model(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("overrides", [
    (),  # SplitFed v2: a shared trunk with momentum
    ("planner=rotate", "planner.cuts=[1,2]"),  # cuts differ and move every round
    ("strategy=sequential",),
    ("strategy=local_loss",),
    # Adam's moments in the trunk's checkpoint; the schedule's factor from the round alone
    ("strategy.optimizer._target_=torch.optim.AdamW", "strategy.lr=0.003",
     "strategy.schedule._target_=torch.optim.lr_scheduler.CosineAnnealingLR"),
], ids=["splitfed_v2", "moving-cuts", "sequential", "local_loss", "adamw-cosine"])
def test_a_resumed_run_ends_where_the_uninterrupted_one_does(tmp_path, overrides):
    common = ("strategy.local_epochs=1", f"strategy.num_rounds={ROUNDS}", *overrides)
    random.seed(0)  # Flower samples (and orders sequential turns) with Python's `random`
    reference = run_local(small_config(*common, run_dir=str(tmp_path / "reference")))
    cfg = small_config(*common, run_dir=str(tmp_path / "crashed"))
    random.seed(0)
    saved, result = crash_then_resume(cfg, crash_at=3)
    assert [r["round"] for r in result.history] == list(range(ROUNDS + 1))
    for mine, theirs in zip(result.history, reference.history, strict=True):
        assert mine["test_accuracy"] == theirs["test_accuracy"], mine["round"]
        assert mine.get("examples") == theirs.get("examples"), mine["round"]
    assert_same_model(result.model, reference.model)
    # The run folder holds each round once, and the checkpoint is the last round's.
    run_dir = Path(cfg.run_dir)
    assert [r["round"] for r in json.loads((run_dir / "metrics.json").read_text())] == [
        0, 1, 2, 3, 4]
    rounds = [int(r["round"]) for r in read_clients(run_dir)]
    assert rounds == sorted(rounds) and set(rounds) == {1, 2, 3, 4}
    assert rounds.count(3) == rounds.count(1)
    assert load_checkpoint(run_dir, config=to_container(cfg)).server_round == ROUNDS
    # The virtual clock carried on from the checkpoint's time.
    clock = [r["virtual_time_s"] for r in result.history]
    assert clock == sorted(clock) and clock[2] == saved.reporter["clock_s"]


def test_resume_refuses_another_experiment_and_a_folder_without_checkpoint(tmp_path):
    cfg = small_config("strategy.num_rounds=1", run_dir=str(tmp_path / "run"))
    run_local(cfg)
    assert (tmp_path / "run" / CHECKPOINT_FILE).is_file()
    other = small_config("strategy.num_rounds=1", "model.cut=2", "resume=true",
                         run_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="another experiment: model.cut differs"):
        start_runtime(other)
    empty = small_config("resume=true", run_dir=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="does not exist: nothing to resume"):
        start_runtime(empty)


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cfg = small_config(f"strategy.num_rounds={ROUNDS}", "logger=wandb", "logger.mode=offline",
                       run_dir=str(tmp_path / "run"))
    saved, _ = crash_then_resume(cfg, crash_at=2)
    folders = sorted(p.name for p in (tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(folders) == 2
    assert {name.rsplit("-", 1)[1] for name in folders} == {saved.sinks["wandb_id"]}


def test_a_resumed_run_with_error_feedback_starts_its_references_over_in_step(tmp_path):
    """Error feedback's references are not in the checkpoint: the devices' copies live in
    their Flower context, which a new run starts empty. So the resumed run starts them over
    on both sides, in step, and carries them again from the round after."""
    cfg = small_config("strategy.local_epochs=1", f"strategy.num_rounds={ROUNDS}",
                       "compression=topk_feedback", run_dir=str(tmp_path / "run"))
    _, result = crash_then_resume(cfg, crash_at=3)
    assert [r["round"] for r in result.history] == list(range(ROUNDS + 1))
    assert all(torch.isfinite(p).all() for p in result.model.parameters())
    rows = [r for r in read_clients(Path(cfg.run_dir)) if r["status"] == "ok"]
    carried = {n: [int(r["feedback_carried"]) for r in rows if int(r["round"]) == n]
               for n in range(1, ROUNDS + 1)}
    assert carried[1] == [0] * cfg.num_clients  # the run's first round
    assert min(carried[2]) > 0  # before the crash, carried in from round 1
    assert carried[3] == [0] * cfg.num_clients  # the resumed run's first round
    assert min(carried[4]) > 0  # carried in again
    assert {r["feedback_restarts"] for r in rows} == {"0"}  # device and trunk never disagreed
