"""Privacy budgets on the server: a wrapper around any protocol's strategy.

Like Flower's ``DifferentialPrivacy*`` wrappers, :class:`PrivacyBudgetGuard`
takes the strategy it protects as an argument and delegates to it. It adds:

* a client that replies with status ``budget`` (its epsilon would pass
  ``privacy.epsilon_max`` if it trained another round; it did not train) is never
  sent a ``train`` message again; the wrapped strategy records the decline like
  any other and averages only finished clients, so a round in which every client
  is out of budget keeps the previous weights;
* federated evaluation is turned off: it would send local activations to the
  trunk outside the accounting. Centralised evaluation is unaffected.

Epsilon itself travels in every reply's metrics and reaches the report through
the wrapped strategy's ``on_round`` hook. Clients are filtered after the wrapped
strategy samples them, so a round may train fewer clients than it sampled.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from strategies.reporting import ReportingFedAvg, reply_status

#: Status of a client that declined a round because its budget is spent.
BUDGET_STATUS = "budget"


class PrivacyBudgetGuard(Strategy):
    """Stop training clients whose privacy budget is spent.

    Parameters
    ----------
    strategy : ReportingFedAvg
        The protocol's strategy.
    """

    def __init__(self, strategy: ReportingFedAvg) -> None:
        self.strategy = strategy
        #: Node ids that declined for budget.
        self.exhausted: set[int] = set()
        self._warned_evaluate = False

    def summary(self) -> None:
        """Log the wrapped strategy's summary and the guard."""
        self.strategy.summary()
        log(INFO, "\t└──> Privacy budget guard: exhausted clients are not sampled again")

    def start(self, *, grid: Grid, **kwargs: Any) -> Any:
        """Flower's loop over the guard's hooks, on the wrapped strategy's grid."""
        return super().start(grid=self.wrap_grid(grid), **kwargs)

    def wrap_grid(self, grid: Grid) -> Grid:
        """Return the wrapped strategy's grid (sequential SL takes turns)."""
        return self.strategy.wrap_grid(grid)

    def checkpoint(self) -> dict[str, Any]:
        """Add the clients out of budget to the wrapped strategy's state."""
        return self.strategy.checkpoint() | {"exhausted": sorted(self.exhausted)}

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue from :meth:`checkpoint`'s state: exhausted clients stay out."""
        self.strategy.restore(saved)
        self.exhausted = set(saved["exhausted"])

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Configure as the wrapped strategy does, minus clients out of budget."""
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        kept = [m for m in messages if m.metadata.dst_node_id not in self.exhausted]
        self.strategy.withdraw(m.metadata.dst_node_id for m in messages
                               if m.metadata.dst_node_id in self.exhausted)
        if len(kept) < len(messages):
            log(INFO, "privacy: %d sampled client(s) are out of budget and skip round %d",
                len(messages) - len(kept), server_round)
        if messages and not kept:
            log(WARNING, "privacy: every sampled client is out of budget; nothing trains")
        return kept

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Remember the clients out of budget; the wrapped strategy does the rest."""
        replies = list(replies)
        self.exhausted |= {
            r.metadata.src_node_id for r in replies
            if reply_status(r, deadline_s=None) == BUDGET_STATUS
        }
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send no federated evaluation: it would release activations outside the accounting."""
        messages = list(self.strategy.configure_evaluate(server_round, arrays, config, grid))
        if messages and not self._warned_evaluate:
            log(WARNING, "privacy: federated evaluation is off (it would send activations "
                "outside the privacy accounting); centralised evaluation still runs")
            self._warned_evaluate = True
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Delegate (closes the wrapped strategy's sessions)."""
        return self.strategy.aggregate_evaluate(server_round, replies)
