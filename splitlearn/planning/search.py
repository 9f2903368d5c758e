"""Per-device options chosen for the round as it is played out at the trunk (pure Python).

The makespan solver (:mod:`splitlearn.planning.solve`) minimises ``max T + sum W``: every
trunk step after the slowest device, an upper bound of the round. The round itself
overlaps the devices' work with the trunk's queue (:mod:`splitlearn.planning.queue`),
where a device's cut trades its own time against the trunk's: a slow device's work can
move to a trunk that would otherwise wait for it. :func:`best_choice` minimises the
played-out round over one option per device:

* exactly, by trying every combination, while there are at most ``exact_limit``;
* otherwise by descent: from each start given (the makespan solver's choice, every
  uniform cut), change one device's option at a time while that shortens the round,
  until no single change does; the best end is kept;
* beyond ``descent_limit`` devices (a pass tries every option of every device, each a
  played-out round), the best start as it is.

Either way it reports a lower bound of the optimum (:func:`lower_bound`), so a plan
states how far from the best it can be: ``found / bound - 1`` (0 when exact, as the
bound is then the optimum itself).

With ``penalties`` (a share per option, >= 0) it minimises the round times ``1 + the
chosen options' shares`` instead: the time to a target when a round's plan changes how
many rounds that takes (a deep cut trains more of the model on one device's skewed
data, so its rounds learn less; :class:`~splitlearn.planning.planners.DynSLPlanner`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from splitlearn.planning.queue import DeviceRound, round_seconds

#: Combinations tried one by one at most (4 cuts for 6 devices).
EXACT_LIMIT = 4096
#: Devices beyond which the starts are compared as they are, without descent (a descent
#: pass at 100 devices and 6 cuts takes about a second here).
DESCENT_LIMIT = 100


@dataclass(frozen=True)
class Choice:
    """One option per device (its index into that device's list) and the round it makes.

    Parameters
    ----------
    picks : tuple[int, ...]
        The chosen option of each device.
    round_s : float
        The round played out with those options.
    bound_s : float
        A lower bound of the best score over every combination.
    exact : bool
        Whether every combination was tried (then ``score_s`` is the optimum).
    score_s : float | None
        What was minimised: the round times 1 + the picks' penalties (None: the round).
    """

    picks: tuple[int, ...]
    round_s: float
    bound_s: float
    exact: bool
    score_s: float | None = None

    @property
    def score(self) -> float:
        """The minimised value: ``score_s``, else the round."""
        return self.round_s if self.score_s is None else self.score_s

    @property
    def gap(self) -> float:
        """How far above the optimum the score can be, at most, as a share of it."""
        if self.exact or self.bound_s <= 0:
            return 0.0
        return max(self.score / self.bound_s - 1.0, 0.0)


def played(options: Sequence[Sequence[DeviceRound]], picks: Sequence[int]) -> float:
    """Return the round with option ``picks[i]`` of every device ``i``."""
    return round_seconds([device[k] for device, k in zip(options, picks, strict=True)])


Penalties = Sequence[Sequence[float]] | None


def scored(options: Sequence[Sequence[DeviceRound]], picks: Sequence[int],
           penalties: Penalties = None) -> float:
    """Return the round with ``picks`` times 1 + their penalties (the round without)."""
    seconds = played(options, picks)
    if penalties is None:
        return seconds
    return seconds * (1.0 + sum(p[k] for p, k in zip(penalties, picks, strict=True)))


def lower_bound(options: Sequence[Sequence[DeviceRound]]) -> float:
    """Return a lower bound of the round over every combination of options.

    No device can end before its fastest option alone, and no trunk before the least
    work its devices can leave it (after the earliest any batch of theirs can arrive).
    """
    if not options:
        return 0.0
    bound = max(min(o.alone_s for o in device) for device in options)
    trunks = {o.trunk for device in options for o in device}
    for trunk in trunks:
        # A device counts for a trunk only where every option of its is served there.
        mine = [device for device in options if all(o.trunk == trunk for o in device)]
        work = sum(min(o.batches * o.trunk_s for o in device) for device in mine)
        first = min((o.before_s + o.up_s for device in mine for o in device if o.batches),
                    default=0.0)
        bound = max(bound, first + work if work > 0 else 0.0)
    return bound


def best_choice(options: Sequence[Sequence[DeviceRound]], *,
                starts: Sequence[Sequence[int]] = (), exact_limit: int = EXACT_LIMIT,
                descent_limit: int = DESCENT_LIMIT, penalties: Penalties = None) -> Choice:
    """Return the options of least played-out round (see the module docstring).

    Parameters
    ----------
    options : Sequence[Sequence[DeviceRound]]
        Each device's options, played (at least one each).
    starts : Sequence[Sequence[int]]
        Where descent starts when the combinations are too many (the first option of
        every device is always one start).
    exact_limit : int
        The most combinations tried one by one.
    descent_limit : int
        The most devices descent runs for.
    penalties : Sequence[Sequence[float]] | None
        A share >= 0 per option of every device: the score is the round times 1 + the
        picks' shares (None: the round alone).
    """
    if any(not device for device in options):
        raise ValueError("best_choice: every device needs at least one option")
    if penalties is not None and (
            [len(p) for p in penalties] != [len(d) for d in options]
            or any(v < 0 or not math.isfinite(v) for p in penalties for v in p)):
        raise ValueError("best_choice: penalties need a finite share >= 0 per option")
    # Both factors of the score are at least their own minimum over the combinations.
    bound = lower_bound(options) * (1.0 + sum(min(p) for p in penalties or ()))
    if math.prod(len(device) for device in options) <= exact_limit:
        picks = min(itertools.product(*(range(len(device)) for device in options)),
                    key=lambda p: scored(options, p, penalties), default=())
        return _choice(options, picks, penalties, bound, exact=True)
    best: tuple[float, tuple[int, ...]] | None = None
    for start in [[0] * len(options), *starts]:
        found = (_descend(options, list(start), penalties) if len(options) <= descent_limit
                 else (scored(options, start, penalties), tuple(start)))
        if best is None or found[0] < best[0]:
            best = found
    assert best is not None
    return _choice(options, best[1], penalties, bound, exact=False)


def _choice(options: Sequence[Sequence[DeviceRound]], picks: Sequence[int],
            penalties: Penalties, bound: float, *, exact: bool) -> Choice:
    return Choice(tuple(picks), played(options, picks), bound, exact=exact,
                  score_s=None if penalties is None else scored(options, picks, penalties))


def _descend(options: Sequence[Sequence[DeviceRound]], picks: list[int],
             penalties: Penalties = None) -> tuple[float, tuple[int, ...]]:
    """Change one device's option at a time while the score falls; the local optimum."""
    current = scored(options, picks, penalties)
    improved = True
    while improved:
        improved = False
        for i, device in enumerate(options):
            for k in range(len(device)):
                if k == picks[i]:
                    continue
                trial = picks[:i] + [k] + picks[i + 1:]
                seconds = scored(options, trial, penalties)
                if seconds < current * (1 - 1e-12):
                    picks, current, improved = trial, seconds, True
    return current, tuple(picks)
