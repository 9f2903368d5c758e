"""Robust aggregation of the devices' copies, per group of stages, and a bound on claimed examples.

The weighted mean of :mod:`splitlearn.merge` lets one device move the round's weights
as far as it likes: its arrays count as they are, weighted by the ``num-examples`` it
reports itself. This module holds the two defences, as tensor maths over the copies of
one round, so that every protocol's strategy (and through it the trunk's per-stage
merge) can use them:

* :func:`bound_claims` caps each device's claimed examples at ``ratio`` x the round's
  (lower) median claim. While fewer than half the devices lie, that median is at most
  an honest device's claim, so no device weighs more than ``ratio`` honest ones.
* :func:`robust_blocks` replaces the mean of the devices' copies by one of Flower's
  robust statistics (``flwr.serverapp.strategy``): ``median`` (FedMedian, Yin et al.
  2018), ``trimmed_mean`` (FedTrimmedAvg), ``krum`` and ``multi_krum`` (Krum and
  MultiKrum, Blanchard et al. 2017) and ``bulyan`` (Bulyan, El Mhamdi et al. 2018),
  each as Flower defines it (see each function).

Flower applies them to whole models. Here devices may hold different stages (per-client
cuts, a U-shaped tail), so the copies are grouped into *blocks*: the keys held by the
same devices. With one cut for all (and under FedAvg) the whole device side is one block
and each method is exactly Flower's; with per-client cuts each stage is aggregated over
only the copies that trained it, as the plain merge does, and Krum's distances are taken
over what those copies share. A block with fewer copies than the method needs for its
``f`` (``RobustRule.least_copies``) is *held*: not aggregated, so its stages keep their
previous weights (where the trunk trained them too, the trunk's copy alone counts). No
update the method cannot vouch for is applied, and the round's metrics say so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from splitlearn.config import AggregationConfig
from splitlearn.merge import weighted_average

#: Methods that keep some copies whole and leave the others out (reported per device).
SELECTING = ("krum", "multi_krum", "bulyan")


@dataclass(frozen=True)
class RobustRule:
    """A robust statistic and the assumption it is run under.

    Parameters
    ----------
    method : str
        ``median``, ``trimmed_mean``, ``krum``, ``multi_krum`` or ``bulyan``.
    num_malicious : int
        f, the copies assumed Byzantine (Flower's ``num_malicious_nodes``).
    trim_fraction : float
        ``trimmed_mean``: the share cut off at each end (Flower's ``beta``).
    multi_krum_selected : int
        ``multi_krum``: copies averaged (Flower's ``num_nodes_to_select``); 0 = n - f.
    """

    method: str
    num_malicious: int = 1
    trim_fraction: float = 0.2
    multi_krum_selected: int = 0

    @classmethod
    def of(cls, aggregation: AggregationConfig | None) -> RobustRule | None:
        """Return the rule ``aggregation.robust`` asks for (None: the weighted mean)."""
        if aggregation is None or aggregation.robust == "none":
            return None
        return cls(aggregation.robust, aggregation.num_malicious, aggregation.trim_fraction,
                   aggregation.multi_krum_selected)

    def trimmed(self, n: int) -> int:
        """Return the copies cut off at each end of a coordinate out of ``n`` (``trimmed_mean``)."""
        return int(self.trim_fraction * n)  # as Flower's trim_mean (and scipy's) count them

    def least_copies(self) -> int:
        """Return the fewest copies of a block the method needs under its assumption.

        ``median``: an honest majority of every coordinate, 2f + 1. ``trimmed_mean``:
        at least f (and at least 1) cut off at each end. ``krum``/``multi_krum``:
        n > 2f + 2 (Blanchard et al. 2017). ``bulyan``: n >= 4f + 3 (El Mhamdi et al.
        2018; Flower's Bulyan skips a round below it).
        """
        f = self.num_malicious
        if self.method == "median":
            return 2 * f + 1
        if self.method == "trimmed_mean":
            n = 1
            while self.trimmed(n) < max(f, 1):
                n += 1
            return n
        if self.method in ("krum", "multi_krum"):
            return 2 * f + 3
        if self.method == "bulyan":
            return 4 * f + 3
        raise ValueError(f"aggregation.robust={self.method!r} is not a robust method")

    def refusal(self, n: int) -> str | None:
        """Say why ``n`` copies are too few for the method (None: they are enough)."""
        least = self.least_copies()
        if n >= least:
            return None
        trims = (f" (it cuts int(aggregation.trim_fraction={self.trim_fraction} x n) copies "
                 "off each end, which must be at least f and at least 1)"
                 if self.method == "trimmed_mean" else "")
        return (f"{self.method} with aggregation.num_malicious={self.num_malicious} needs at "
                f"least {least} copies{trims}, got {n}")

    def selected(self, n: int) -> int:
        """Return the copies Multi-Krum averages out of ``n``: m, at most the n - f honest."""
        honest = n - self.num_malicious
        return honest if self.multi_krum_selected == 0 else min(self.multi_krum_selected, honest)


@dataclass(frozen=True)
class Block:
    """One group of keys held by the same devices, aggregated over their copies.

    Parameters
    ----------
    keys : tuple of str
        The block's keys, in the order the first holder sent them.
    holders : tuple of int
        Indices (into the round's copies) of the devices holding the block.
    state : dict[str, Tensor]
        The aggregate, each tensor in its own dtype (integer buffers rounded). A held
        block carries its first holder's tensors, only as placeholders.
    weight : float
        The (bounded) examples of every holder: the share the device side has
        beside a trusted copy of the same stages, as in the plain merge (0 when held).
    kept : tuple of int
        The holders the statistic used (a selecting method leaves some out).
    trimmed : int
        Kept copies left out of each coordinate's mean (``trimmed_mean``: both ends;
        ``bulyan``: those farthest from the median).
    held : str, optional
        Why the block was not aggregated (its stages keep their previous weights).
    """

    keys: tuple[str, ...]
    holders: tuple[int, ...]
    state: dict[str, Tensor]
    weight: float
    kept: tuple[int, ...]
    trimmed: int = 0
    held: str | None = None


def bound_updates(states: Sequence[Mapping[str, Tensor]], given: Sequence[Mapping[str, Tensor]],
                  ratio: float) -> tuple[list[dict[str, Tensor]], list[int]]:
    """Shorten every device's update of a module beyond ``ratio`` x the round's median update.

    Parameters
    ----------
    states : Sequence[Mapping[str, Tensor]]
        Each device's trained arrays.
    given : Sequence[Mapping[str, Tensor]]
        What each device was given this round (its update is ``state - given``).
    ratio : float
        The bound's multiple of the median; 0 leaves the states as they are.

    Returns
    -------
    tuple[list[dict[str, Tensor]], list[int]]
        The states (an update within the bound keeps the very tensors it came with, so an
        honest round is averaged exactly as before) and, per device, the modules shortened.

    Notes
    -----
    Norm bounding (Sun et al. 2019, "Can you really backdoor federated learning?"), per
    *module*: the arrays whose keys differ only in their last component (a layer's
    weight, bias and statistics), each compared over the devices that hold it, so that
    per-client cuts and each cut's head compare like with like. A shortened update keeps
    its direction: ``given + (state - given) x bound / norm``. The lower median of the
    holders' update norms is at most an honest one's while fewer than half of them lie, so
    a scaled or negated copy moves the mean by at most ``ratio`` honest updates. Integer
    arrays (batch-norm counters) and keys a device was not given are left as they are; a
    module whose median update is 0 (most holders did not change it) is not bounded.
    """
    out = [dict(state) for state in states]
    shortened = [0] * len(states)
    if ratio <= 0:
        return out, shortened
    holders: dict[str, list[tuple[int, list[str]]]] = {}
    for index, (state, sent) in enumerate(zip(states, given, strict=True)):
        modules: dict[str, list[str]] = {}
        for key, value in state.items():
            before = sent.get(key)
            if before is not None and value.is_floating_point() and before.shape == value.shape:
                modules.setdefault(key.rpartition(".")[0], []).append(key)
        for module, keys in modules.items():
            holders.setdefault(module, []).append((index, keys))
    for held in holders.values():
        norms = [float(torch.stack([(states[i][k].double() - given[i][k].double()).norm()
                                    for k in keys]).norm()) for i, keys in held]
        median = sorted(norms)[(len(norms) - 1) // 2]
        if median <= 0:
            continue
        bound = ratio * median
        for (index, keys), norm in zip(held, norms, strict=True):
            if norm > bound:
                scale = bound / norm
                for key in keys:
                    before = given[index][key]
                    out[index][key] = (before + (states[index][key] - before) * scale).to(
                        states[index][key].dtype)
                shortened[index] += 1
    return out, shortened


def bound_claims(claims: Sequence[float], ratio: float) -> list[float]:
    """Cap every claimed count at ``ratio`` x the lower median of ``claims``.

    Parameters
    ----------
    claims : Sequence[float]
        The examples (or whatever weighs the mean) each device reports.
    ratio : float
        The cap's multiple of the median; 0 leaves the claims as they are.

    Returns
    -------
    list[float]
        The claims, each one that is not above the cap the very same value (so a
        round without liars is averaged exactly as before), the others the cap.

    Notes
    -----
    The lower median (the ``(n - 1) // 2``-th smallest claim) is at most the largest
    honest claim while fewer than half the devices lie, so a liar weighs at most
    ``ratio`` honest devices. A median of 0 leaves the claims unbounded (no cap
    would leave a positive total).
    """
    if ratio <= 0 or not claims:
        return list(claims)
    median = sorted(claims)[(len(claims) - 1) // 2]
    if median <= 0:
        return list(claims)
    cap = ratio * median
    return [claim if claim <= cap else cap for claim in claims]


def blocks_of(states: Sequence[Mapping[str, Tensor]]) -> list[tuple[tuple[int, ...], list[str]]]:
    """Group the keys by the devices that hold them, in first-seen order.

    Parameters
    ----------
    states : Sequence[Mapping[str, Tensor]]
        The round's copies.

    Returns
    -------
    list[tuple[tuple[int, ...], list[str]]]
        ``(holders, keys)`` per block. Under per-client cuts a device holds whole
        stages, so a block is the stages held by the same devices.
    """
    holders: dict[str, list[int]] = {}
    for index, state in enumerate(states):
        for key in state:
            holders.setdefault(key, []).append(index)
    blocks: dict[tuple[int, ...], list[str]] = {}
    for key, held_by in holders.items():
        blocks.setdefault(tuple(held_by), []).append(key)
    return list(blocks.items())


def robust_blocks(updates: Sequence[tuple[Mapping[str, Tensor], float]], rule: RobustRule
                  ) -> list[Block]:
    """Aggregate each block of the round's copies with ``rule``.

    Parameters
    ----------
    updates : Sequence[tuple[Mapping[str, Tensor], float]]
        Each device's copy and its (already bounded) weight, in a fixed order.
    rule : RobustRule
        The statistic and its assumption.

    Returns
    -------
    list[Block]
        One per block, held where too few devices hold it for ``rule``.
    """
    blocks = []
    for holders, keys in blocks_of([state for state, _ in updates]):
        weight = sum(updates[i][1] for i in holders)
        copies = [updates[i][0] for i in holders]
        refusal = rule.refusal(len(holders))
        if refusal is not None:
            placeholders = {k: copies[0][k] for k in keys}
            blocks.append(Block(tuple(keys), holders, placeholders, 0.0, (), held=refusal))
            continue
        state, kept, trimmed = _aggregate(copies, [updates[i][1] for i in holders], keys, rule)
        blocks.append(Block(tuple(keys), holders, state, weight,
                            tuple(holders[i] for i in kept), trimmed))
    return blocks


def _aggregate(copies: Sequence[Mapping[str, Tensor]], weights: Sequence[float],
               keys: Sequence[str], rule: RobustRule) -> tuple[dict[str, Tensor], list[int], int]:
    """Return one block's aggregate, the copies it kept (indices) and how many it trimmed."""
    n = len(copies)
    everyone = list(range(n))
    stack = {k: torch.stack([c[k].detach() for c in copies]) for k in keys}
    if rule.method == "median":
        return {k: _in_dtype(coordinate_median, s) for k, s in stack.items()}, everyone, 0
    if rule.method == "trimmed_mean":
        cut = rule.trimmed(n)
        return ({k: _in_dtype(lambda x: trimmed_mean(x, cut), s) for k, s in stack.items()},
                everyone, 2 * cut)
    flat = torch.stack([torch.cat([c[k].detach().double().flatten() for k in keys])
                        for c in copies])
    f = rule.num_malicious
    if rule.method == "krum":
        best = krum_select(flat, f, 1)[0]
        return {k: copies[best][k].detach().clone() for k in keys}, [best], 0
    if rule.method == "multi_krum":
        chosen = krum_select(flat, f, rule.selected(n))
        # Weighted by (bounded) examples as Flower's MultiKrum averages its selection;
        # equally where the chosen claim none (nothing to weigh them by).
        shares = [weights[i] for i in chosen] if sum(weights[i] for i in chosen) > 0 \
            else [1.0] * len(chosen)
        mean = weighted_average([({k: copies[i][k] for k in keys}, w)
                                 for i, w in zip(chosen, shares, strict=True)])
        return mean, chosen, 0
    # Bulyan as Flower's: theta = n - 2f copies chosen by Multi-Krum, then per coordinate
    # the mean of the beta = theta - 2f of them closest to their median.
    theta = n - 2 * f
    chosen = krum_select(flat, f, theta)
    beta = theta - 2 * f
    return ({k: _in_dtype(lambda x: closest_to_median_mean(x, beta), s[chosen])
             for k, s in stack.items()}, chosen, theta - beta)


def _in_dtype(statistic: Callable[[Tensor], Tensor], stack: Tensor) -> Tensor:
    """Apply ``statistic`` over axis 0 in ``stack``'s dtype (integers: in float64, rounded)."""
    if stack.dtype.is_floating_point:
        return statistic(stack)
    return statistic(stack.double()).round().to(stack.dtype)


def coordinate_median(stack: Tensor) -> Tensor:
    """Return the median of every coordinate over axis 0 (FedMedian: ``np.median``'s).

    With an even count it is the mean of the two middle values, as ``np.median`` has it
    (``torch.median`` would return the lower one).
    """
    n = stack.shape[0]
    ordered = stack.sort(dim=0).values
    if n % 2:
        return ordered[n // 2].clone()
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def trimmed_mean(stack: Tensor, cut: int) -> Tensor:
    """Return each coordinate's mean over axis 0 without its ``cut`` lowest and highest values.

    Flower's FedTrimmedAvg (``trim_mean``, after scipy's): unweighted, ``cut`` =
    ``int(beta x n)``.
    """
    n = stack.shape[0]
    return stack.sort(dim=0).values[cut:n - cut].mean(dim=0)


def krum_scores(flat: Tensor, num_malicious: int) -> Tensor:
    """Return Krum's score of every row: summed squared distances to its n - f - 2 nearest.

    As Flower's ``select_multikrum`` (at least one neighbour), in float64 and from the
    differences themselves (Flower expands ``|x|^2 + |y|^2 - 2xy``, which loses digits
    for nearby copies).
    """
    n = flat.shape[0]
    distances = torch.cdist(flat, flat, compute_mode="donot_use_mm_for_euclid_dist").square()
    neighbours = max(1, n - num_malicious - 2)
    scores = []
    for i in range(n):
        others = torch.cat([distances[i, :i], distances[i, i + 1:]])
        scores.append(others.sort().values[:neighbours].sum())
    return torch.stack(scores)


def krum_select(flat: Tensor, num_malicious: int, count: int) -> list[int]:
    """Return the ``count`` rows of lowest Krum score, in row order (Krum: 1; Multi-Krum: m).

    Ties go to the earlier row (a stable sort), so a round is aggregated the same way
    in every run; the kept rows are returned in their own order, the order they are
    then averaged in.
    """
    order = torch.argsort(krum_scores(flat, num_malicious), stable=True)
    return sorted(int(i) for i in order[:count])


def closest_to_median_mean(stack: Tensor, beta: int) -> Tensor:
    """Return per coordinate the mean of the ``beta`` values closest to the median (Bulyan).

    Flower's ``aggregate_n_closest_weights`` around ``np.median``; ties in distance go
    to the earlier row.
    """
    median = coordinate_median(stack)
    order = torch.argsort((stack - median).abs(), dim=0, stable=True)[:beta]
    return torch.gather(stack, 0, order).mean(dim=0)
