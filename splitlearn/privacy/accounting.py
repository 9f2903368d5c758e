"""Privacy accounting: pure RDP maths plus one small stateful accountant.

The stateless part turns a history of Gaussian steps ``(noise_multiplier,
sample_rate, num_steps)`` into epsilon with Opacus's RDP analysis
(:mod:`opacus.accountants.analysis.rdp`, Mironov et al. 2019), the same sums
:class:`opacus.accountants.RDPAccountant` makes, with each ``(noise_multiplier,
sample_rate)`` pair's one-step RDP computed once per process. The stateful
:class:`PrivacyAccountant` records steps in an ``RDPAccountant`` (``step``,
``state_dict``) and keeps the history as plain lists, so a client can store it
between rounds (in Flower's ``context.state``) and rebuild it exactly.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from opacus.accountants import RDPAccountant

# Opacus is imported where it is used: importing it takes seconds, and every ClientApp,
# trunk worker and ServerApp process imports this module whether or not it adds noise.

#: One entry of an accountant's history: (noise_multiplier, sample_rate, num_steps).
Step = tuple[float, float, int]

#: Keys of :meth:`PrivacyAccountant.to_lists` (dashes: they go into Flower records).
HISTORY_KEYS = ("noise-multiplier", "sample-rate", "num-steps")


class PrivacyBudgetExhausted(RuntimeError):
    """Training one more round would take a client's epsilon past its budget.

    Parameters
    ----------
    epsilon_spent : float
        Epsilon already spent (before the refused round).
    epsilon_next : float
        Epsilon the round would have brought it to.
    epsilon_max : float
        The budget.
    """

    #: Reply status of a client that declines a round for this reason.
    kind = "budget"

    def __init__(self, *, epsilon_spent: float, epsilon_next: float, epsilon_max: float) -> None:
        super().__init__(
            f"privacy budget exhausted: epsilon {epsilon_spent:.3f} spent, the next round "
            f"would reach {epsilon_next:.3f} > epsilon_max {epsilon_max:.3f}"
        )
        self.epsilon_spent = epsilon_spent
        self.epsilon_next = epsilon_next
        self.epsilon_max = epsilon_max


def check_step(*, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> Step:
    """Validate one history entry and return it as a typed tuple."""
    if not noise_multiplier > 0:
        raise ValueError(
            f"noise_multiplier must be > 0 to account for it, got {noise_multiplier!r}"
        )
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
        raise ValueError(f"num_steps must be an int >= 0, got {num_steps!r}")
    return float(noise_multiplier), float(sample_rate), num_steps


def compute_epsilon(
    *, history: Iterable[Step], delta: float, alphas: Sequence[float] | None = None
) -> float:
    """Epsilon at ``delta`` after composing the Gaussian steps in ``history`` (RDP).

    Parameters
    ----------
    history : Iterable[Step]
        ``(noise_multiplier, sample_rate, num_steps)`` entries; each is
        ``num_steps`` Poisson-subsampled Gaussian mechanisms (``sample_rate=1``:
        the plain Gaussian mechanism).
    delta : float
        Target delta, in (0, 1).
    alphas : Sequence[float], optional
        RDP orders; Opacus's defaults when omitted.

    Returns
    -------
    float
        Epsilon (0 for an empty history).
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp as rdp_analysis

    orders = tuple(alphas or RDPAccountant.DEFAULT_ALPHAS)
    entries = [check_step(noise_multiplier=s, sample_rate=q, num_steps=n) for s, q, n in history]
    entries = [e for e in entries if e[2] > 0]
    if not entries:
        return 0.0
    # Opacus's compute_rdp is one step's RDP times the steps; RDPAccountant sums the entries.
    rdp = sum([_one_step_rdp(s, q, orders) * n for s, q, n in entries])
    with _quiet_order_warning():
        eps, _ = rdp_analysis.get_privacy_spent(orders=list(orders), rdp=rdp, delta=delta)
    return float(eps)


@functools.lru_cache(maxsize=1024)
def _one_step_rdp(noise_multiplier: float, sample_rate: float, orders: tuple[float, ...]
                  ) -> np.ndarray:
    """RDP of one subsampled Gaussian step at each order (read-only; memoised).

    Below sample rate 1 the fractional orders' series cost about 0.35 s per pair on a
    slow host, and a device's history repeats the same pair round after round: its
    epsilon was that cost twice per round (before and after charging).
    """
    from opacus.accountants.analysis import rdp as rdp_analysis

    rdp = rdp_analysis.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                   orders=list(orders))
    rdp.flags.writeable = False
    return rdp


@contextmanager
def _quiet_order_warning() -> Iterator[None]:
    # Opacus warns when the best RDP order is the smallest one: that happens only
    # for epsilons in the hundreds and up, where a tighter bound changes nothing.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the smallest alpha")
        yield


class PrivacyAccountant:
    """Opacus's RDP accountant's history, kept as plain lists, and its epsilon.

    Parameters
    ----------
    history : Iterable[Step], optional
        Steps already taken (e.g. restored with :meth:`from_lists`).
    """

    def __init__(self, history: Iterable[Step] = ()) -> None:
        self._rdp: RDPAccountant | None = None  # made at the first step
        self.extend(history)

    def _accountant(self) -> RDPAccountant:
        if self._rdp is None:
            from opacus.accountants import RDPAccountant

            self._rdp = RDPAccountant()
        return self._rdp

    def step(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Record ``num_steps`` Gaussian steps at ``(noise_multiplier, sample_rate)``."""
        s, q, n = check_step(
            noise_multiplier=noise_multiplier, sample_rate=sample_rate, num_steps=num_steps
        )
        for _ in range(n):  # Opacus merges equal consecutive steps into one entry
            self._accountant().step(noise_multiplier=s, sample_rate=q)

    def extend(self, steps: Iterable[Step]) -> None:
        """Record several history entries in order."""
        for s, q, n in steps:
            self.step(noise_multiplier=s, sample_rate=q, num_steps=n)

    @property
    def history(self) -> list[Step]:
        """A copy of the history: ``(noise_multiplier, sample_rate, num_steps)`` entries."""
        if self._rdp is None:
            return []
        return [tuple(entry) for entry in self._rdp.state_dict()["history"]]  # type: ignore[misc]

    @property
    def num_steps(self) -> int:
        """Steps recorded so far."""
        return sum(n for _, _, n in self.history)

    def epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta``.

        What ``RDPAccountant.get_epsilon`` gives, bit for bit, at its default orders
        (see :func:`compute_epsilon`).
        """
        return compute_epsilon(history=self.history, delta=delta)

    def epsilon_unamplified(self, delta: float) -> float:
        """Epsilon at ``delta`` with every step taken at sample rate 1.

        Sampling amplifies privacy only against an observer who does not see
        which examples a step used. The trunk's server sees every batch (its
        activations and labels arrive in the frames), so against it a DP-SGD
        step at rate q is worth no more than one at rate 1.
        """
        return compute_epsilon(history=[(s, 1.0, n) for s, _, n in self.history], delta=delta)

    def epsilon_after(self, steps: Iterable[Step], *, delta: float) -> float:
        """Epsilon if ``steps`` were recorded next (this accountant is not changed)."""
        return PrivacyAccountant([*self.history, *steps]).epsilon(delta)

    def spend(self, steps: Sequence[Step], *, delta: float, epsilon_max: float | None) -> float:
        """Record ``steps`` unless they would take epsilon past ``epsilon_max``.

        Charging before the work is done keeps the count safe when a round fails
        half-way: rows already sent are paid for.

        Returns
        -------
        float
            Epsilon after the steps.

        Raises
        ------
        PrivacyBudgetExhausted
            If the steps would exceed the budget; nothing is recorded then.
        """
        epsilon_next = self.epsilon_after(steps, delta=delta)
        if epsilon_max is not None and epsilon_next > epsilon_max:
            raise PrivacyBudgetExhausted(
                epsilon_spent=self.epsilon(delta), epsilon_next=epsilon_next,
                epsilon_max=epsilon_max,
            )
        self.extend(steps)
        return epsilon_next

    def to_lists(self) -> dict[str, list[float] | list[int]]:
        """Return the history as three parallel lists (keys :data:`HISTORY_KEYS`)."""
        history = self.history
        return {
            "noise-multiplier": [float(s) for s, _, _ in history],
            "sample-rate": [float(q) for _, q, _ in history],
            "num-steps": [int(n) for _, _, n in history],
        }

    @classmethod
    def from_lists(cls, lists: Mapping[str, Sequence[float] | Sequence[int]]) -> PrivacyAccountant:
        """Rebuild an accountant from :meth:`to_lists` output."""
        missing = [k for k in HISTORY_KEYS if k not in lists]
        if missing:
            raise ValueError(f"accountant history lacks {missing}; expected keys {HISTORY_KEYS}")
        columns = [list(lists[k]) for k in HISTORY_KEYS]
        if len({len(c) for c in columns}) != 1:
            raise ValueError(f"accountant history lists differ in length: {lists!r}")
        return cls(zip(*columns, strict=True))

    def __repr__(self) -> str:
        return f"PrivacyAccountant(history={self.history!r})"
