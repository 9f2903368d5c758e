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
        A lower bound of the best round over every combination.
    exact : bool
        Whether every combination was tried (then ``round_s`` is the optimum).
    """

    picks: tuple[int, ...]
    round_s: float
    bound_s: float
    exact: bool

    @property
    def gap(self) -> float:
        """How far above the optimum the round can be, at most, as a share of it."""
        if self.exact or self.bound_s <= 0:
            return 0.0
        return max(self.round_s / self.bound_s - 1.0, 0.0)


def played(options: Sequence[Sequence[DeviceRound]], picks: Sequence[int]) -> float:
    """Return the round with option ``picks[i]`` of every device ``i``."""
    return round_seconds([device[k] for device, k in zip(options, picks, strict=True)])


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
                descent_limit: int = DESCENT_LIMIT) -> Choice:
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
    """
    if any(not device for device in options):
        raise ValueError("best_choice: every device needs at least one option")
    bound = lower_bound(options)
    if math.prod(len(device) for device in options) <= exact_limit:
        picks = min(itertools.product(*(range(len(device)) for device in options)),
                    key=lambda p: played(options, p), default=())
        return Choice(tuple(picks), played(options, picks), bound, exact=True)
    best: tuple[float, tuple[int, ...]] | None = None
    for start in [[0] * len(options), *starts]:
        found = (_descend(options, list(start)) if len(options) <= descent_limit
                 else (played(options, start), tuple(start)))
        if best is None or found[0] < best[0]:
            best = found
    assert best is not None
    return Choice(best[1], best[0], bound, exact=False)


def _descend(options: Sequence[Sequence[DeviceRound]], picks: list[int]
             ) -> tuple[float, tuple[int, ...]]:
    """Change one device's option at a time while the round shortens; the local optimum."""
    current = played(options, picks)
    improved = True
    while improved:
        improved = False
        for i, device in enumerate(options):
            for k in range(len(device)):
                if k == picks[i]:
                    continue
                trial = picks[:i] + [k] + picks[i + 1:]
                seconds = played(options, trial)
                if seconds < current * (1 - 1e-12):
                    picks, current, improved = trial, seconds, True
    return current, tuple(picks)
