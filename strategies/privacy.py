"""Privacy budgets on the server: a wrapper around any training strategy.

Like Flower's ``DifferentialPrivacy*`` wrappers, :class:`PrivacyBudgetGuard`
takes the strategy it protects as an argument and delegates to it. It adds
three things:

* A client that replies with status ``budget`` (its epsilon would pass
  ``privacy.epsilon_max`` if it trained another round; it did not train) is
  recorded and never sent a ``train`` message again. Its reply never reaches
  the wrapped strategy's aggregation, so a round in which every client is out
  of budget keeps the previous weights instead of dividing by zero examples.
* The round's ``epsilon`` metric is the largest epsilon any client has
  reported so far (the worst-off client's privacy spent, monotone over rounds),
  and ``clients-budget`` counts the sampled clients out of budget (declined or
  skipped); both are reported even in a round where nobody trained.
* Federated evaluation is turned off: it would send local activations to the
  trunk outside the accounting. Centralised evaluation is unaffected.

Clients are filtered after the wrapped strategy samples them, so with
``fraction_train < 1`` a round may train fewer clients than it sampled; this
never blocks waiting for nodes.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from splitlearn.privacy.budget import BUDGET_STATUS, EPSILON_METRIC
from splitlearn.task import STATUS_KEY
from strategies.failures import client_row


def declined_for_budget(reply: Message) -> bool:
    """Whether ``reply`` says the client's privacy budget is spent."""
    if reply.has_error():
        return False
    status = reply.content.config_records.get(STATUS_KEY)
    return status is not None and str(status["status"]) == BUDGET_STATUS


def reported_epsilon(reply: Message) -> float | None:
    """Return the epsilon a (non-error) reply reports, if any."""
    if reply.has_error():
        return None
    for metrics in reply.content.metric_records.values():
        if EPSILON_METRIC in metrics:
            return float(metrics[EPSILON_METRIC])
    return None


class PrivacyBudgetGuard(Strategy):
    """Stop training clients whose privacy budget is spent; report the worst epsilon.

    Attributes the guard does not define (``client_rows``, ``train_metrics``,
    ``task`` ...) are the wrapped strategy's, so round reporters keep working.

    Parameters
    ----------
    strategy : Strategy
        The strategy to protect (e.g. SplitFed).
    """

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        #: Node id -> epsilon it had when it declined for budget.
        self.exhausted: dict[int, float] = {}
        #: Node id -> latest epsilon it reported.
        self.epsilons: dict[int, float] = {}
        self._warned_evaluate = False
        self._skipped = 0  # sampled this round but out of budget

    def __getattr__(self, name: str) -> Any:
        if name == "strategy":  # not set yet (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.strategy, name)

    def summary(self) -> None:
        """Log the wrapped strategy's summary and the guard."""
        self.strategy.summary()
        log(INFO, "\t└──> Privacy budget guard: exhausted clients are not sampled again")

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Configure as the wrapped strategy does, minus clients out of budget."""
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        kept = [m for m in messages if m.metadata.dst_node_id not in self.exhausted]
        self._skipped = len(messages) - len(kept)
        if len(kept) < len(messages):
            log(INFO, "privacy: %d sampled client(s) are out of budget and skip round %d",
                len(messages) - len(kept), server_round)
        if messages and not kept:
            log(WARNING, "privacy: every sampled client is out of budget; nothing trains")
        return kept

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Set aside budget declines, aggregate the rest, report epsilon."""
        replies = list(replies)
        declined = [r for r in replies if declined_for_budget(r)]
        for reply in replies:
            if (epsilon := reported_epsilon(reply)) is not None:
                self.epsilons[reply.metadata.src_node_id] = epsilon
        for reply in declined:
            node = reply.metadata.src_node_id
            self.exhausted[node] = self.epsilons.get(node, float("nan"))
        arrays, metrics = self.strategy.aggregate_train(
            server_round, [r for r in replies if not declined_for_budget(r)]
        )
        rows = getattr(self.strategy, "client_rows", None)
        if isinstance(rows, dict) and declined:
            rows.setdefault(server_round, []).extend(
                client_row(r, BUDGET_STATUS) for r in declined
            )
        out_of_budget = len(declined) + self._skipped
        self._skipped = 0
        if metrics is None and (self.epsilons or out_of_budget):
            # Nobody trained: still report the budget state, where reporters look for it.
            metrics = MetricRecord({"num-examples": 0})
            recorded = getattr(self.strategy, "train_metrics", None)
            if isinstance(recorded, dict):
                recorded[server_round] = metrics
        if metrics is not None:
            metrics[f"clients-{BUDGET_STATUS}"] = out_of_budget
            if self.epsilons:
                metrics[EPSILON_METRIC] = max(self.epsilons.values())
        return arrays, metrics

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
