"""A resumed run: Flower's loop over rounds ``done + 1 .. num_rounds`` of the same run.

``Strategy.start`` always counts rounds from 1. :class:`ResumedRounds` wraps the
run's strategy (protocol, privacy guard) and hands every hook the run's own round
number, ``done`` more than Flower's, so clients see the rounds continue (their
shuffles, tokens and device draws are keyed by it) and nothing is numbered twice.
The initial evaluation (Flower's round 0) is skipped: it happened before the crash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy


class ResumedRounds(Strategy):
    """Run ``strategy`` from round ``done + 1`` on.

    Parameters
    ----------
    strategy : Strategy
        The run's strategy, restored from its checkpoint (it has ``wrap_grid``).
    done : int
        Rounds the run had completed.
    """

    def __init__(self, strategy: Strategy, *, done: int) -> None:
        self.strategy = strategy
        self.done = done

    def summary(self) -> None:
        """Log the wrapped strategy's summary and where the run resumes."""
        self.strategy.summary()
        log(INFO, "\t└──> Resumed after round %d", self.done)

    def start(
        self, *, grid: Grid, num_rounds: int = 3,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        **kwargs: Any,
    ) -> Result:
        """Flower's loop for the rounds left (``num_rounds`` is the run's total)."""
        def shifted(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if server_round == 0 or evaluate_fn is None:
                return None  # evaluated before the crash
            return evaluate_fn(server_round + self.done, arrays)

        return super().start(grid=self.wrap_grid(grid), num_rounds=num_rounds - self.done,
                             evaluate_fn=shifted, **kwargs)

    def checkpoint(self) -> dict[str, Any]:
        """Return the wrapped strategy's state (the round count is the checkpoint's own)."""
        return self.strategy.checkpoint()  # type: ignore[attr-defined]

    def wrap_grid(self, grid: Grid) -> Grid:
        """Return the wrapped strategy's grid."""
        return self.strategy.wrap_grid(grid)  # type: ignore[attr-defined]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Configure the run's round ``server_round + done``."""
        return self.strategy.configure_train(server_round + self.done, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate the run's round ``server_round + done``."""
        return self.strategy.aggregate_train(server_round + self.done, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Configure the run's evaluation of round ``server_round + done``."""
        return self.strategy.configure_evaluate(server_round + self.done, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Aggregate the run's evaluation of round ``server_round + done``."""
        return self.strategy.aggregate_evaluate(server_round + self.done, replies)
