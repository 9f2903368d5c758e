"""Cut a :class:`~splitlearn.models.SplittableModel` into client and server parts.

State-dict key convention
-------------------------
``split(model, cut)[0]`` is ``nn.Sequential(*model.stages[:cut])``, so its
state-dict keys are ``"<i>.<param>"`` where ``i`` is the *stage index in the
model*. Client-side weights therefore have the same keys for every cut (stage
2's conv weight is ``"2.0.weight"`` whether the cut is 3 or 4), which lets
weights from clients with different cuts be aggregated per key. The trunk's
keys are renumbered from 0 (``i - cut``) and are not cut-independent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import Tensor, nn

from splitlearn.models.base import SplittableModel


def split(model: SplittableModel, cut: int) -> tuple[nn.Sequential, nn.Sequential]:
    """Split ``model`` into ``(bottom, trunk)`` at ``cut``.

    Parameters
    ----------
    model : SplittableModel
        The model to split.
    cut : int
        Number of stages given to the bottom (client); one of
        ``model.valid_cuts``.

    Returns
    -------
    tuple[nn.Sequential, nn.Sequential]
        ``(Sequential(stages[:cut]), Sequential(stages[cut:]))``. Both halves
        share the model's modules (no copy): training either half trains
        ``model``. Deep-copy the result if independent halves are needed.

    Raises
    ------
    ValueError
        If ``cut`` is not a valid cut; the message lists the valid cuts.
    """
    cut = model.check_cut(cut)
    stages = list(model.stages)
    return nn.Sequential(*stages[:cut]), nn.Sequential(*stages[cut:])


def bottom_state_keys(model: SplittableModel, cut: int) -> list[str]:
    """Return the state-dict keys of the bottom at ``cut``.

    Parameters
    ----------
    model : SplittableModel
        The model.
    cut : int
        A valid cut.

    Returns
    -------
    list[str]
        Keys ``"<stage index>.<name>"`` of parameters and buffers (e.g.
        BatchNorm running statistics) of stages ``[0, cut)``.
    """
    return list(split(model, cut)[0].state_dict().keys())


def bottom_state(model: SplittableModel, cut: int) -> dict[str, Tensor]:
    """Return detached copies of the bottom's state at ``cut``.

    Parameters
    ----------
    model : SplittableModel
        The model.
    cut : int
        A valid cut.

    Returns
    -------
    dict[str, Tensor]
        Parameters and buffers of stages ``[0, cut)``, keyed as in
        :func:`bottom_state_keys`; later changes to the model do not affect it.
    """
    state = split(model, cut)[0].state_dict()
    return {key: value.detach().clone() for key, value in state.items()}


def load_bottom_state(model: SplittableModel, state: Mapping[str, Tensor]) -> None:
    """Load a bottom state dict (keys ``"<stage index>.…"``) into ``model``.

    Only the stages referenced by ``state`` are touched, and each of them must
    be fully provided (strict per stage). Everything is validated before any
    tensor is copied, so a bad state leaves the model unchanged.

    Parameters
    ----------
    model : SplittableModel
        The model to update in place.
    state : Mapping[str, Tensor]
        Tensors keyed as produced by :func:`bottom_state`.

    Raises
    ------
    ValueError
        If a key does not name an existing stage, or a referenced stage has
        missing, unexpected or wrongly shaped entries.
    """
    grouped = _group_by_stage(model, state)
    for index, sub in grouped.items():
        _check_stage_state(index, model.stages[index], sub)
    for index, sub in grouped.items():
        model.stages[index].load_state_dict(sub, strict=True)


def resolve_tail_cut(model: SplittableModel, cut: int, tail_cut: int) -> int:
    """Return the U-shaped tail cut: the client keeps stages ``[tail_cut, num_stages)``.

    Parameters
    ----------
    model : SplittableModel
        The model.
    cut : int
        A valid cut: the client's head is stages ``[0, cut)``.
    tail_cut : int
        First stage of the client's tail; 0 means the last stage only
        (``num_stages - 1``).

    Returns
    -------
    int
        The tail cut, with ``cut < tail_cut < num_stages``.

    Raises
    ------
    ValueError
        If the pair leaves the trunk no stage or the client no tail; the
        message names both cuts and the accepted range.
    """
    cut = model.check_cut(cut)
    resolved = tail_cut or model.num_stages - 1
    if isinstance(tail_cut, bool) or not cut < resolved < model.num_stages:
        raise ValueError(
            f"invalid U-shaped cuts: cut={cut}, tail_cut={tail_cut!r}; need "
            f"cut < tail_cut < {model.num_stages} (0 = {model.num_stages - 1}, the last stage)"
        )
    return resolved


def split_u(
    model: SplittableModel, cut: int, tail_cut: int
) -> tuple[nn.Sequential, nn.Sequential, nn.Sequential]:
    """Split ``model`` into ``(head, trunk, tail)`` for U-shaped split learning.

    The head (stages ``[0, cut)``) and the tail (``[tail_cut, num_stages)``)
    stay on the device with the labels; the trunk (``[cut, tail_cut)``) runs on
    the server. Like :func:`split`, the parts share the model's modules.
    ``tail_cut`` 0 means the last stage only (see :func:`resolve_tail_cut`).
    """
    tail_cut = resolve_tail_cut(model, cut, tail_cut)
    stages = list(model.stages)
    return (
        nn.Sequential(*stages[:cut]),
        nn.Sequential(*stages[cut:tail_cut]),
        nn.Sequential(*stages[tail_cut:]),
    )


def stages_state(model: SplittableModel, indices: Iterable[int]) -> dict[str, Tensor]:
    """Return detached copies of whole stages' state, keyed ``"<stage index>.<name>"``.

    The keys are those of :func:`bottom_state`, so any set of whole stages (a
    U-shaped client's head and tail) loads back with :func:`load_bottom_state`
    and is averaged per key like a bottom.
    """
    return {
        f"{index}.{key}": value.detach().clone()
        for index in indices
        for key, value in model.stages[index].state_dict().items()
    }


def ushaped_state(model: SplittableModel, cut: int, tail_cut: int) -> dict[str, Tensor]:
    """Client-side state of a U-shaped split: head ``[0, cut)`` plus tail ``[tail_cut, n)``."""
    tail_cut = resolve_tail_cut(model, cut, tail_cut)
    return stages_state(model, [*range(cut), *range(tail_cut, model.num_stages)])


def _group_by_stage(
    model: SplittableModel, state: Mapping[str, Tensor]
) -> dict[int, dict[str, Tensor]]:
    """Split ``"<i>.<rest>"`` keys into per-stage dicts keyed by ``<rest>``."""
    grouped: dict[int, dict[str, Tensor]] = {}
    for key, value in state.items():
        head, _, rest = key.partition(".")
        if not head.isdigit() or not rest or int(head) >= model.num_stages:
            raise ValueError(
                f"key {key!r} does not name a stage of a model with "
                f"{model.num_stages} stages (expected '<stage index>.<name>')"
            )
        grouped.setdefault(int(head), {})[rest] = value
    return grouped


def _check_stage_state(index: int, stage: nn.Module, sub: Mapping[str, Tensor]) -> None:
    """Raise ValueError unless ``sub`` matches ``stage``'s state dict exactly."""
    expected = stage.state_dict()
    missing = sorted(set(expected) - set(sub))
    unexpected = sorted(set(sub) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"stage {index} state mismatch: missing {missing}, unexpected {unexpected}"
        )
    wrong = [k for k in expected if tuple(expected[k].shape) != tuple(sub[k].shape)]
    if wrong:
        raise ValueError(f"stage {index} shape mismatch for {wrong}")
