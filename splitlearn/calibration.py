"""What client training costs: this host's measured speed, estimated memory, the cut table.

The clock turns measured client compute seconds into device seconds with the
ratio ``host_flops_per_s / device.flops_per_s``. The host figure is measured on
the workload clients actually run (the client-side stages at the configured
cut and batch size), with the same thread count, not taken from a datasheet.

:func:`client_train_memory_bytes` estimates a client's training memory, with or
without activation recomputation, from the stages' reported costs;
:func:`cut_costs` turns those costs into the planner's per-cut table
(:class:`splitlearn.planning.cost.CutCost`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

import torch
from torch import nn

from splitlearn.communication import Sizes
from splitlearn.evaluation import intra_op_threads
from splitlearn.models import SplittableModel, StageCost
from splitlearn.models.base import FLOAT32_BYTES, segment_memory_bytes_per_sample
from splitlearn.models.lean import lean_stage_costs
from splitlearn.planning.cost import CutCost
from splitlearn.stages import split

#: Backward costs about twice the forward (gradients w.r.t. inputs and weights).
TRAIN_TO_FORWARD_FLOPS = 3
#: Float32 copies of each trained parameter: the weights, their gradients, SGD momentum.
PARAM_STATE_COPIES = 3


def client_train_flops_per_sample(model: SplittableModel, cut: int) -> int:
    """Training FLOPs per sample of the client-side stages (forward + backward)."""
    forward = sum(c.flops_per_sample for c in model.stage_costs()[:cut])
    return TRAIN_TO_FORWARD_FLOPS * forward


def client_train_memory_bytes(
    model: SplittableModel, cut: int, *, batch_size: int, recompute: bool = False,
    frees_output: bool = False,
) -> int:
    """Estimated training memory of stages ``[0, cut)`` for one batch, in bytes.

    Both variants add the parameters, their gradients and one SGD momentum
    buffer, all float32 (``3 * 4 * params``), to the activations held:

    * plain: what autograd saves for backward plus the output at the cut,
      :func:`~splitlearn.models.base.segment_memory_bytes_per_sample` (a
      boundary tensor both neighbours save is counted once);
    * ``recompute``: every stage but the last is recomputed in backward, so the
      forward keeps only their boundaries: the input of each (the batch itself
      for stage 0), plus the last stage's saved tensors and the output at the
      cut. Backward runs the last stage first, then rebuilds one stage at a
      time; while it rebuilds stage ``i`` the device holds the inputs of stages
      ``0 .. i``, the output at the cut (the step keeps it until the batch
      ends) and stage ``i``'s own saved tensors (its input excluded, being a
      boundary already); the inputs of later stages were freed when their
      backward finished. The estimate is the largest of these moments;
    * ``recompute`` and ``frees_output`` (a step that drops the output at the
      cut once it is sent, before the backward): the last stage is recomputed
      too, with a :class:`~splitlearn.models.lean.MaskReLU` at the cut. The
      forward ends holding every stage's input and the output; after the
      exchange the output is gone and backward rebuilds each stage in turn,
      the last first (its saved tensors profiled with the mask), while the
      inputs of that stage and the ones before it are held.

    Per-sample figures come from :meth:`SplittableModel.stage_costs` and scale
    with the batch. That profile runs in eval mode, so two things training
    saves besides are handled here: BatchNorm's per-channel batch mean and
    inverse std (added, ``8 * channels`` bytes per layer whatever the batch)
    and dropout masks (not added: one byte per element of a dropout's input,
    about 0.1% of VGG-11's classifier side). Tensors no layer saves
    (temporaries, the gradients flowing backward) are not counted;
    :class:`clients.memory.MemoryMeter` measures the same quantity.

    Parameters
    ----------
    model : SplittableModel
        The network.
    cut : int
        Stages ``[0, cut)`` are trained; ``model.num_stages`` means the whole model.
    batch_size : int
        Samples per batch.
    recompute : bool, optional
        Per-stage activation recomputation (:mod:`clients.recompute`).
    frees_output : bool, optional
        With ``recompute``: the step frees the output at the cut once sent
        (the split steps do), so the last stage is recomputed too.

    Returns
    -------
    int
        Bytes.

    Raises
    ------
    ValueError
        If ``cut`` is not in ``1 .. model.num_stages``.
    """
    lean = recompute and frees_output
    costs = _client_costs(model, cut, lean_last=lean)
    return _train_memory_bytes(model, costs, batch_size=batch_size, recompute=recompute,
                               output_recomputed=lean)


def cross_entropy_memory_bytes(num_classes: int, *, batch_size: int) -> int:
    """Bytes cross-entropy saves for backward when the device holds the loss.

    Its log-probabilities (float32), the labels (int64) and a float32 scalar
    (the total weight). Add it when the loss is computed on the device (e.g.
    whole-model training); :func:`client_train_memory_bytes` covers stages only.
    """
    return batch_size * (FLOAT32_BYTES * num_classes + 8) + FLOAT32_BYTES


def cut_costs(
    model: SplittableModel, *, batch_size: int, leak: Mapping[int, float] | None = None,
    tail_cut: int | None = None, frees_output: bool = False,
) -> list[CutCost]:
    """Build the planner's cost table: one :class:`CutCost` per valid cut.

    Parameters
    ----------
    model : SplittableModel
        The network; profiled once with :meth:`SplittableModel.stage_costs`.
    batch_size : int
        Batch size, for the memory columns.
    leak : Mapping[int, float] | None, optional
        Measured attack scores by cut; cuts not in it get None.
    tail_cut : int | None, optional
        U-shaped learning: the device also trains stages ``[tail_cut, n)`` and the
        loss, the trunk only ``[cut, tail_cut)``; only cuts below it are listed.
    frees_output : bool, optional
        The protocol's step drops the output at the cut once sent (see
        :func:`client_train_memory_bytes`): recomputation then rebuilds the
        last stage too.

    Returns
    -------
    list[CutCost]
        In cut order. Client FLOPs are 3 forwards of ``[0, c)`` (plus the tail),
        recomputation one more forward of ``[0, c)`` with ``frees_output``, else
        of ``[0, c - 1)`` (the last stage is not recomputed), the trunk's 3
        forwards of ``[c, n)`` (or of ``[c, tail_cut)``); smashed bytes are stage
        ``c - 1``'s output (float32; plus the features at the tail cut, which
        come down as the activations go up, and whose gradient goes up as the
        cut's comes down); parameter bytes are float32 weights of the device's
        stages.
    """
    costs = model.stage_costs()
    lean = lean_stage_costs(model) if frees_output else None
    leak = leak or {}
    cuts = [c for c in model.valid_cuts if tail_cut is None or c < tail_cut]
    table = [
        _cut_cost(model, costs, cut, batch_size=batch_size, leak=leak.get(cut), lean=lean)
        for cut in cuts
    ]
    if tail_cut is None:
        return table
    return [_with_tail(model, cost, costs, tail_cut, batch_size=batch_size) for cost in table]


def _cut_cost(
    model: SplittableModel, costs: list[StageCost], cut: int, *, batch_size: int,
    leak: float | None, lean: list[StageCost] | None = None,
) -> CutCost:
    """Build one row of :func:`cut_costs`.

    ``lean`` (the stages with a masked ReLU at the cut) is given when the step
    frees its output, so that recomputation also rebuilds the last stage.
    """
    client, server = costs[:cut], costs[cut:]
    forward = sum(c.flops_per_sample for c in client)
    rebuilt_stages = client if lean is not None else client[:-1]
    rebuilt = sum(c.flops_per_sample for c in rebuilt_stages)
    recomputed = client if lean is None else [*client[:-1], lean[cut - 1]]
    params = sum(c.params for c in client)
    return CutCost(
        cut=cut,
        client_flops_per_sample=float(TRAIN_TO_FORWARD_FLOPS * forward),
        recompute_flops_per_sample=float(rebuilt),
        server_flops_per_sample=float(
            TRAIN_TO_FORWARD_FLOPS * sum(c.flops_per_sample for c in server)
        ),
        smashed_bytes_per_sample=client[-1].activation_bytes_per_sample,
        client_param_bytes=FLOAT32_BYTES * params,
        memory_bytes=_train_memory_bytes(model, client, batch_size=batch_size),
        recompute_memory_bytes=_train_memory_bytes(
            model, recomputed, batch_size=batch_size, recompute=True,
            output_recomputed=lean is not None,
        ),
        leak=leak,
    )


def _with_tail(model: SplittableModel, cost: CutCost, costs: list[StageCost], tail_cut: int, *,
               batch_size: int) -> CutCost:
    """``cost`` for a U-shaped client that also trains stages ``[tail_cut, n)``."""
    tail = costs[tail_cut:]
    tail_flops = float(TRAIN_TO_FORWARD_FLOPS * sum(c.flops_per_sample for c in tail))
    tail_memory = tail_train_memory_bytes(model, tail_cut, batch_size=batch_size)
    return replace(
        cost,
        client_flops_per_sample=cost.client_flops_per_sample + tail_flops,
        server_flops_per_sample=cost.server_flops_per_sample - tail_flops,
        smashed_bytes_per_sample=cost.smashed_bytes_per_sample
        + costs[tail_cut - 1].activation_bytes_per_sample,
        client_param_bytes=cost.client_param_bytes + FLOAT32_BYTES * sum(c.params for c in tail),
        memory_bytes=cost.memory_bytes + tail_memory,
        recompute_memory_bytes=cost.recompute_memory_bytes + tail_memory,
        exchanges_per_batch=2,
    )


def communication_sizes(model: SplittableModel, cut: int, *, tail_cut: int | None = None
                        ) -> Sizes:
    """Return the sizes :func:`splitlearn.communication.bytes_per_sample` needs at ``cut``.

    Values of an example's activation at the cut (and at ``tail_cut``, U-shaped),
    and the bytes of the state a round ships: the client's stages (below the cut,
    and from the tail cut on) and the whole model's (parameters and buffers).
    """
    stages = list(model.stages)
    client = [*stages[:_checked_cut(model, cut)], *(stages[tail_cut:] if tail_cut else [])]
    return Sizes(
        cut_entries=math.prod(model.cut_shape(cut)), client_param_bytes=_state_bytes(client),
        model_param_bytes=_state_bytes(stages),
        tail_entries=math.prod(model.cut_shape(tail_cut)) if tail_cut else 0,
        client_arrays=sum(len(m.state_dict()) for m in client),
        model_arrays=sum(len(m.state_dict()) for m in stages),
    )


def _state_bytes(modules: list[nn.Module]) -> int:
    return sum(t.numel() * t.element_size() for m in modules for t in m.state_dict().values())


def tail_train_memory_bytes(model: SplittableModel, tail_cut: int, *, batch_size: int) -> int:
    """Estimated training memory of a U-shaped tail ``[tail_cut, n)`` for one batch, in bytes.

    Its saved activations plus its parameters, their gradients and one momentum
    buffer (float32); the tail is never recomputed.
    """
    tail = model.stage_costs()[tail_cut:]
    return (sum(c.train_memory_bytes_per_sample for c in tail) * batch_size
            + PARAM_STATE_COPIES * FLOAT32_BYTES * sum(c.params for c in tail))


def _train_memory_bytes(
    model: SplittableModel, costs: list[StageCost], *, batch_size: int, recompute: bool = False,
    output_recomputed: bool = False,
) -> int:
    """Estimate as :func:`client_train_memory_bytes` does, for the stages of ``costs``."""
    if recompute:
        per_sample = _recompute_bytes_per_sample(
            model, costs, output_recomputed=output_recomputed)
    else:
        per_sample = segment_memory_bytes_per_sample(costs)
    params = sum(c.params for c in costs)
    return (
        per_sample * batch_size
        + _batch_norm_statistics_bytes(model.stages[: len(costs)])
        + PARAM_STATE_COPIES * FLOAT32_BYTES * params
    )


def _batch_norm_statistics_bytes(stages: nn.Module) -> int:
    """Bytes of the batch mean and inverse std that BatchNorm saves in training.

    The profile behind ``stage_costs`` runs in eval mode, where BatchNorm saves
    its running statistics (buffers) instead; these are per channel, whatever
    the batch size.
    """
    return sum(
        2 * FLOAT32_BYTES * m.num_features
        for m in stages.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    )


def _client_costs(model: SplittableModel, cut: int, *, lean_last: bool = False
                  ) -> list[StageCost]:
    """Stage costs of ``[0, cut)``, where ``cut`` may also be the whole model.

    ``lean_last``: the last stage's costs as with a
    :class:`~splitlearn.models.lean.MaskReLU` at the cut.
    """
    whole = isinstance(cut, int) and not isinstance(cut, bool) and cut == model.num_stages
    if not whole:
        cut = _checked_cut(model, cut)
    costs = model.stage_costs()[:cut]
    if lean_last:
        costs[-1] = lean_stage_costs(model)[cut - 1]
    return costs


def _checked_cut(model: SplittableModel, cut: int) -> int:
    try:
        return model.check_cut(cut)
    except ValueError:
        raise ValueError(
            f"cut must be an int in 1..{model.num_stages} (num_stages trains the "
            f"whole model), got {cut!r}"
        ) from None


def _recompute_bytes_per_sample(
    model: SplittableModel, costs: list[StageCost], *, output_recomputed: bool = False
) -> int:
    """Peak of the end of the forward and of backward's rebuilds (see the caller)."""
    # inputs[i]: bytes of stage i's input, the batch itself for stage 0.
    inputs = [FLOAT32_BYTES * math.prod(model.input_shape)]
    inputs += [c.activation_bytes_per_sample for c in costs[:-1]]
    last = costs[-1]
    held_output = last.activation_bytes_per_sample
    if output_recomputed:
        # The output is sent and dropped before the backward, which rebuilds every stage.
        return max(sum(inputs) + held_output, *(
            sum(inputs[: i + 1]) + cost.train_memory_bytes_per_sample
            - cost.input_saved_bytes_per_sample
            for i, cost in enumerate(costs)))
    # The last stage runs plain: at the end of the forward the recomputed stages'
    # inputs, the last stage's saved tensors and the output at the cut are held.
    forward_end = sum(inputs[:-1]) + segment_memory_bytes_per_sample([last])
    rebuilds = (
        sum(inputs[: i + 1]) + held_output
        + cost.train_memory_bytes_per_sample - cost.input_saved_bytes_per_sample
        for i, cost in enumerate(costs[:-1])
    )
    return max([forward_end, *rebuilds])


def measure_host_flops_per_s(
    model: SplittableModel,
    cut: int,
    *,
    batch_size: int,
    threads: int = 1,
    min_seconds: float = 0.3,
) -> float:
    """Sustained training FLOP/s of this host on the client-side stages.

    Parameters
    ----------
    model : SplittableModel
        The model (not modified: a copy of its bottom is trained on noise).
    cut : int
        Client-side stages ``[0, cut)``.
    batch_size : int
        Batch size clients use.
    threads : int
        Intra-op threads, as the clients use.
    min_seconds : float
        Measure at least this long (after one warm-up step).
    """
    import copy

    bottom, _ = split(copy.deepcopy(model), cut)
    inputs = torch.rand(batch_size, *model.input_shape)
    flops_per_step = client_train_flops_per_sample(model, cut) * batch_size
    return flops_per_step / _median_step_s(lambda: _train_step(bottom, inputs),
                                           threads=threads, min_seconds=min_seconds)


def _median_step_s(step: Callable[[], None], *, threads: int, min_seconds: float) -> float:
    """Median seconds of ``step`` after a warm-up, over at least ``min_seconds`` and 3 steps.

    The median: a step that another process interrupted does not set the figure.
    """
    with intra_op_threads(threads):
        step()  # warm-up: allocator, kernels
        step_s: list[float] = []
        started = time.perf_counter()
        while time.perf_counter() - started < min_seconds or len(step_s) < 3:
            begun = time.perf_counter()
            step()
            step_s.append(time.perf_counter() - begun)
    return statistics.median(step_s)


def measure_trunk_step_s(
    model: SplittableModel,
    cut: int,
    *,
    batch_size: int,
    end: int | None = None,
    threads: int = 1,
    min_seconds: float = 0.05,
    precision: str = "fp32",
) -> float:
    """Median seconds of one trunk training step of stages ``[cut, end)`` where it runs.

    The step a trunk takes for one batch: forward (under ``precision``'s autocast, on the
    device ``model``'s weights are on), a loss, backward to its weights and to the
    activations it was sent (their gradient goes back), a plain SGD update. Noise as
    input; ``model`` is not modified. What the step costs beyond its FLOPs (at a deep
    cut, most of it) is what the planner's trunk model learns from these.
    """
    import copy

    from splitlearn.accelerators import autocast, synchronize

    stages = nn.Sequential(*copy.deepcopy(model.stages[_checked_cut(model, cut):end]))
    device = next(model.parameters()).device
    inputs = torch.rand(batch_size, *model.cut_shape(cut), device=device, requires_grad=True)
    params = [p for p in stages.parameters() if p.requires_grad]

    def step() -> None:
        with autocast(device, precision):
            out = stages(inputs)
        out.float().square().mean().backward()
        with torch.no_grad():
            for param in params:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-1e-6)
                    param.grad = None
        inputs.grad = None
        synchronize(device)  # the step's time, not the time to queue it

    return _median_step_s(step, threads=threads, min_seconds=min_seconds)


def _train_step(bottom: nn.Module, inputs: torch.Tensor) -> None:
    out = bottom(inputs)
    out.backward(torch.ones_like(out))
    bottom.zero_grad(set_to_none=True)
