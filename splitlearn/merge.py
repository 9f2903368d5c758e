"""The round's merge when clients hold different cuts: each stage over every copy that trained it.

A client with cut ``c`` trains its own copy of stages ``[0, c)``; the trunk trains
stages ``[c, n)`` for it (one shared trunk, or a copy per client in SplitFed v1).
At round end every stage is the average of all the copies that trained it,
weighted by the samples each copy was trained on: client copies by the client's
samples, the shared trunk's copy of stage ``s`` by the samples of the clients
whose cut is at or below ``s``. With equal cuts this is SplitFed v2 (client
stages: FedAvg of the client copies; trunk stages: the trunk's own); with a trunk
copy per client it is FedAvg of the whole model whatever the cuts, since each
client then trained every stage once, split between its two copies.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class StageCopy:
    """One copy of some stages and the samples each of its stages was trained on.

    Parameters
    ----------
    state : Mapping[str, Tensor]
        Tensors keyed ``"<stage index>.<name>"`` (a client's state, or a trunk's).
    stage_samples : Mapping[int, int]
        Samples per stage index; a stage missing or at 0 was not trained by this copy.
    """

    state: Mapping[str, Tensor]
    stage_samples: Mapping[int, int]


def stage_of(key: str) -> int:
    """Stage index of a ``"<stage index>.<name>"`` key."""
    return int(key.partition(".")[0])


def client_copy(state: Mapping[str, Tensor], samples: int) -> StageCopy:
    """Return a client's copy: every stage it sent was trained on all its samples."""
    return StageCopy(state, {stage_of(k): samples for k in state})


def trunk_copy(state: Mapping[str, Tensor], stage_samples: Sequence[int]) -> StageCopy:
    """Return a trunk's copy: its books say which stages it trained, on how many samples."""
    return StageCopy(state, {i: n for i, n in enumerate(stage_samples) if n > 0})


def merge_stages(copies: Sequence[StageCopy]) -> dict[str, Tensor]:
    """Average each stage over the copies that trained it, weighted by their samples.

    Parameters
    ----------
    copies : Sequence[StageCopy]
        Client and trunk copies of one round.

    Returns
    -------
    dict[str, Tensor]
        The merged tensors of every stage at least one copy trained, keyed like
        the inputs, in each tensor's own dtype (integer buffers such as
        BatchNorm's batch count are rounded).
    """
    weights: dict[int, list[tuple[StageCopy, int]]] = defaultdict(list)
    for copy in copies:
        for stage, samples in copy.stage_samples.items():
            if samples > 0:
                weights[stage].append((copy, samples))
    merged: dict[str, Tensor] = {}
    for stage, holders in weights.items():
        total = sum(n for _, n in holders)
        keys = [k for k in holders[0][0].state if stage_of(k) == stage]
        for key in keys:
            merged[key] = _weighted_mean([(c.state[key], n / total) for c, n in holders])
    return merged


def weighted_average(
    parts: Sequence[tuple[Mapping[str, Tensor], int]],
) -> dict[str, Tensor]:
    """Average states with the same keys, weighted by samples, as FedAvg does.

    Used for what no stage index keys (local loss's auxiliary heads, one cut's).
    """
    total = sum(n for _, n in parts)
    return {key: _weighted_mean([(state[key], n / total) for state, n in parts])
            for key in parts[0][0]}


def _weighted_mean(parts: Sequence[tuple[Tensor, float]]) -> Tensor:
    first, weight = parts[0]
    if len(parts) == 1:  # a single copy is kept bit for bit
        return first.detach().clone()
    if not first.dtype.is_floating_point:  # counts: averaged exactly, then rounded
        total = sum(t.detach().double() * w for t, w in parts)
        assert isinstance(total, Tensor)
        return total.round().to(first.dtype)
    # In the tensors' own precision and in order, as Flower's FedAvg adds them up, so
    # that equal cuts give SplitFed v2's numbers to the bit.
    merged = first.detach() * weight
    for tensor, w in parts[1:]:
        merged += tensor.detach() * w
    return merged


def client_stages(
    merged: dict[str, Tensor], current: Mapping[str, Tensor], clients: Sequence[StageCopy], *,
    upto: int,
) -> dict[str, Tensor]:
    """Return what the clients hold after the merge.

    That is every stage below ``upto`` (the deepest cut; ``current`` for those no
    copy trained) and every stage a client copy holds above it (a U-shaped tail).
    """
    held = set(range(upto)).union(*(c.stage_samples for c in clients))
    return {k: merged.get(k, v) for k, v in current.items() if stage_of(k) in held}
