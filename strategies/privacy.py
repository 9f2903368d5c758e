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
from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping, Strategy

from splitlearn.privacy.accounting import compute_epsilon
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


def update_epsilon(*, noise_multiplier: float, releases: int, delta: float) -> float:
    """Client-level epsilon of ``releases`` noised sums of clipped updates (RDP, no sampling).

    Each round releases the sum of the finishing devices' clipped updates plus
    Gaussian noise of std ``noise_multiplier x clip`` (then divided by their
    number, which is post-processing): one Gaussian mechanism of that multiplier
    at add/remove-one-device adjacency. No amplification by sampling is claimed:
    the server chooses who takes part.
    """
    return compute_epsilon(history=[(noise_multiplier, 1.0, releases)], delta=delta)


class ClippedUpdateNoise(DifferentialPrivacyClientSideFixedClipping):
    """Flower's DP-FedAvg with client-side clipping, at the hooks our strategies add.

    Flower's wrapper sends the clip bound in every train message (each device
    clips its own update before it leaves, see ``clients.app``) and adds
    Gaussian noise of std ``noise_multiplier x clip / n`` to the average. Here
    ``n`` is the number of devices the wrapped strategy actually averaged, so the
    noise on their sum is always ``noise_multiplier x clip`` (with Flower's fixed
    ``num_sampled_clients`` a round with fewer finishers would get less). Rounds
    keep the wrapped strategy's reporting: an error reply (a device whose app
    failed) is left out before Flower's check, which would skip the whole
    round, and the device counts as lost. The epsilon spent so far is each
    round's ``update-epsilon`` metric.

    Parameters
    ----------
    strategy : ReportingFedAvg
        The protocol's strategy, unwrapped (a :class:`PrivacyBudgetGuard` goes
        around this wrapper); it must average uniformly: ``weighted_by_key``
        ``update-weight``, which clipping devices report as 1.
    noise_multiplier : float
        Sigma; 0 clips without noise (no epsilon is reported).
    clipping_norm : float
        The L2 bound of one device's update.
    delta : float
        The delta epsilon is reported at.
    """

    def __init__(self, strategy: ReportingFedAvg, *, noise_multiplier: float,
                 clipping_norm: float, delta: float) -> None:
        super().__init__(strategy, noise_multiplier, clipping_norm, num_sampled_clients=1)
        self.delta = delta
        self.releases = 0
        if noise_multiplier > 0:
            strategy.extra_metrics = self._epsilon_after

    @property
    def num_sampled_clients(self) -> int:
        """The devices the wrapped strategy averaged (the noise's divisor)."""
        return max(self.strategy.averaged, 1)

    @num_sampled_clients.setter
    def num_sampled_clients(self, value: int) -> None:
        """Ignore Flower's fixed count: the round's own is read when the noise is added."""

    def _epsilon_after(self, finished: list[Message]) -> dict[str, float]:
        return {"update-epsilon": update_epsilon(noise_multiplier=self.noise_multiplier,
                                                 releases=self.releases + 1, delta=self.delta)}

    def start(self, *, grid: Grid, **kwargs: Any) -> Any:
        """Flower's loop over the wrapper's hooks, on the wrapped strategy's grid."""
        return super().start(grid=self.wrap_grid(grid), **kwargs)

    def wrap_grid(self, grid: Grid) -> Grid:
        """Return the wrapped strategy's grid (secure aggregation runs its stages there)."""
        return self.strategy.wrap_grid(grid)

    def withdraw(self, nodes: Iterable[int]) -> None:
        """Tell the wrapped strategy that ``nodes`` were not sent their messages."""
        self.strategy.withdraw(nodes)

    def checkpoint(self) -> dict[str, Any]:
        """Add the releases so far (the epsilon) to the wrapped strategy's state."""
        return self.strategy.checkpoint() | {"update-releases": self.releases}

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue from :meth:`checkpoint`'s state: the epsilon goes on from where it was."""
        self.strategy.restore(saved)
        self.releases = int(saved["update-releases"])

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's clip-and-noise aggregation over the replies that are not errors."""
        kept = [r for r in replies if not r.has_error()]
        self.strategy.averaged = len(kept)  # Flower's count check; the strategy sets the exact one
        arrays, metrics = super().aggregate_train(server_round, kept)
        if arrays is not None and self.noise_multiplier > 0:
            self.releases += 1
        return arrays, metrics
