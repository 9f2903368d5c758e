"""Checkpoints of a run, so that a ServerApp that crashed resumes where it stopped.

After every round the ServerApp writes ``checkpoint.pt`` into the run folder
(atomically: a crash while writing leaves the previous checkpoint). It holds
everything that carries over to the next round:

* the round number and the global arrays (the client-side weights the clients are sent);
* the trunk: its weights, its optimizer state (momentum) and its books;
* the strategy: last statuses, the planner and what it measured, the clients out
  of privacy budget;
* the reporter: virtual clock, history, elapsed time; the sinks' rows and the
  W&B run's id (the resumed run continues it);
* the composed config, so that a resume with another experiment is refused;
* the process's random states, so that Flower samples the clients it would have.

Clients keep their own privacy spend (``context.state`` on their SuperNode, or
their ledger file), so a restarted ServerApp cannot reset it. ``resume=true``
with the same ``run_dir`` continues from round ``k + 1`` (see
:class:`strategies.resume.ResumedRounds`); rounds a crashed run had begun after
its last checkpoint run again, and its rows after that checkpoint are dropped.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from splitlearn.atomic import write_atomic

#: The checkpoint's file name in the run folder.
CHECKPOINT_FILE = "checkpoint.pt"
#: Config keys that may differ between a run and its resumption (where it runs, how
#: long, what it logs to); everything else must be the experiment's own.
RESUMABLE_KEYS = ("resume", "run_dir", "logger", "engine", "dataplane", "server.device",
                  "strategy.num_rounds", "strategy.round_timeout_s")


@dataclass
class RunCheckpoint:
    """A run's state after round ``server_round``."""

    server_round: int
    arrays: dict[str, np.ndarray]
    trunk: dict[str, Any]
    strategy: dict[str, Any]
    reporter: dict[str, Any]
    sinks: dict[str, Any]
    config: dict[str, Any]
    measured: dict[str, Any]  # the host's FLOP/s the virtual clock converted compute with
    rng: dict[str, Any]  # the process's random states: Flower samples clients with `random`


def random_states() -> dict[str, Any]:
    """Return the process-wide random states (Python's, NumPy's, PyTorch's CPU one)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def restore_random_states(states: dict[str, Any]) -> None:
    """Put back :func:`random_states`: a resumed run samples as the uninterrupted one would."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])


def save_checkpoint(run_dir: str | Path, checkpoint: RunCheckpoint) -> None:
    """Write ``checkpoint`` into ``run_dir`` atomically."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    write_atomic(Path(run_dir) / CHECKPOINT_FILE, buffer.getvalue())


def load_checkpoint(run_dir: str | Path, *, config: dict[str, Any]) -> RunCheckpoint:
    """Read the run folder's checkpoint, checking that it belongs to ``config``'s experiment.

    The file is unpickled (it holds the planner's Python objects): resume only
    from a run folder this server wrote.

    Raises
    ------
    ValueError
        If there is no checkpoint, or it was written for another experiment
        (the message names the first key that differs).
    """
    path = Path(run_dir) / CHECKPOINT_FILE
    if not path.is_file():
        raise ValueError(f"resume=true but {path} does not exist: nothing to resume "
                         "(run without resume=true to start this run)")
    checkpoint: RunCheckpoint = torch.load(path, weights_only=False)
    if (key := first_difference(checkpoint.config, config)) is not None:
        raise ValueError(f"{path} was written by another experiment: {key} differs "
                         f"({lookup(checkpoint.config, key)!r} then, {lookup(config, key)!r} "
                         "now); resume with the run's own config")
    return checkpoint


def first_difference(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> str | None:
    """Return the first dotted key whose value differs (resumable keys aside), or None."""
    for key in sorted(set(saved) | set(now)):
        name = f"{prefix}{key}"
        if name in RESUMABLE_KEYS:
            continue
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            if (inner := first_difference(a, b, f"{name}.")) is not None:
                return inner
        elif a != b:
            return name
    return None


def lookup(config: dict[str, Any], key: str) -> Any:
    """Return ``config``'s value at the dotted ``key`` (None where it is missing)."""
    value: Any = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value
