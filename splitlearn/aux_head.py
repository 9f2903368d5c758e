"""The auxiliary head of local-loss split learning, and its place in the client state.

With the ``local_loss`` protocol (Han et al. 2021, "Accelerating Federated
Learning with Split Learning on Locally Generated Losses") a client trains its
bottom stages against a small head of its own instead of waiting for the
trunk's gradient. The head lives with the client side: its weights travel in
the same ArrayRecord as the bottom's and are FedAvg'd with them, under keys
``"aux.<name>"`` that can never clash with stage keys (``"<stage index>.…"``,
see :mod:`splitlearn.stages`). The head is not part of the evaluated model: it
only trains the bottom, so anything that loads a client state into a
:class:`~splitlearn.models.SplittableModel` first takes the aux entries out
with :func:`split_client_state`.

A head's input is the activations at its client's cut, so clients of one round
at different cuts (per-client cuts, ``planner=``) train heads of different
shapes. The global arrays therefore keep one head per cut, under
``"aux@<cut>.<name>"`` (:func:`cut_aux_prefix`); each client is sent its own
cut's head under the plain prefix, and heads are averaged only among the
clients that hold the same cut (:func:`heads_by_cut`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

#: Prefix of the auxiliary head's keys in a client state / ArrayRecord.
AUX_PREFIX = "aux."
#: What every head key starts with, a client's (``aux.``) or a cut's (``aux@<cut>.``).
_HEAD_MARK = "aux"


def cut_aux_prefix(cut: int) -> str:
    """Prefix of the head for ``cut`` in the global arrays (``"aux@<cut>."``)."""
    return f"{_HEAD_MARK}@{int(cut)}."


def heads_by_cut(
    state: Mapping[str, Tensor],
) -> tuple[dict[str, Tensor], dict[int, dict[str, Tensor]]]:
    """Separate global arrays into stage entries and each cut's head.

    Returns
    -------
    tuple[dict[str, Tensor], dict[int, dict[str, Tensor]]]
        ``(stages, heads)``: stage entries unchanged; per cut, its head's
        entries without the prefix (ready for ``head.load_state_dict``).

    Raises
    ------
    ValueError
        If a head key does not name a cut (``"aux@<cut>.<name>"``).
    """
    stages: dict[str, Tensor] = {}
    heads: dict[int, dict[str, Tensor]] = {}
    for key, value in state.items():
        if not key.startswith(_HEAD_MARK):
            stages[key] = value
            continue
        cut, dot, name = key[len(_HEAD_MARK) + 1:].partition(".")
        if not key.startswith(_HEAD_MARK + "@") or not dot or not cut.isdigit():
            raise ValueError(f"{key!r} is not a cut's head key ('aux@<cut>.<name>')")
        heads.setdefault(int(cut), {})[name] = value
    return stages, heads


def keyed_heads(heads: Mapping[int, Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Flatten heads by cut back into ``"aux@<cut>.<name>"`` entries."""
    return {cut_aux_prefix(cut) + name: value
            for cut, head in heads.items() for name, value in head.items()}


def build_aux_head(
    cut_shape: Sequence[int], num_classes: int, *, hidden: int = 0, seed: int | None = None
) -> nn.Sequential:
    """Build the head that turns activations at the cut into class logits.

    Parameters
    ----------
    cut_shape : Sequence[int]
        Per-sample shape of the activations at the cut (``model.cut_shape(cut)``).
    num_classes : int
        Number of classes.
    hidden : int
        0: one linear layer on the flattened activations (the paper's choice for
        small heads); otherwise a two-layer MLP with this many hidden units.
    seed : int, optional
        If given, initialisation is deterministic for this seed.

    Returns
    -------
    nn.Sequential
        ``Flatten, Linear`` or ``Flatten, Linear, ReLU, Linear``.
    """
    if hidden < 0:
        raise ValueError(f"aux hidden units must be >= 0, got {hidden}")
    features = math.prod(cut_shape)

    def make() -> nn.Sequential:
        if hidden == 0:
            return nn.Sequential(nn.Flatten(), nn.Linear(features, num_classes))
        return nn.Sequential(
            nn.Flatten(), nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    if seed is None:
        return make()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def aux_state(head: nn.Module) -> dict[str, Tensor]:
    """Return detached copies of the head's state under :data:`AUX_PREFIX` keys."""
    return {AUX_PREFIX + k: v.detach().clone() for k, v in head.state_dict().items()}


def split_client_state(
    state: Mapping[str, Tensor],
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Separate a client state into stage entries and aux-head entries.

    Returns
    -------
    tuple[dict[str, Tensor], dict[str, Tensor]]
        ``(stages, aux)``: ``stages`` keeps the ``"<stage index>.…"`` keys
        unchanged (ready for :func:`~splitlearn.stages.load_bottom_state`);
        ``aux`` holds the head's entries with :data:`AUX_PREFIX` removed (ready
        for ``head.load_state_dict``). Empty when the protocol has no head.
    """
    stages: dict[str, Tensor] = {}
    aux: dict[str, Tensor] = {}
    for key, value in state.items():
        if key.startswith(AUX_PREFIX):
            aux[key[len(AUX_PREFIX):]] = value
        else:
            stages[key] = value
    return stages, aux


def without_aux(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Return the stage entries of a client state or the global arrays (any head left out)."""
    return {k: v for k, v in state.items() if not k.startswith(_HEAD_MARK)}
