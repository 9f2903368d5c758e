"""Base class for models that can be cut into a client part and a server part.

A :class:`SplittableModel` is an ordered list of *stages*. Cutting at ``k``
gives stages ``[0, k)`` to the client (the "bottom") and stages
``[k, num_stages)`` to the server (the "trunk").

Cost accounting
---------------
:meth:`SplittableModel.stage_costs` profiles each stage with one forward pass
on a single all-zero sample (eval mode, so BatchNorm running statistics are
left untouched). All numbers are per sample:

* ``params`` -- trainable parameters owned by the stage.
* ``flops_per_sample`` -- forward FLOPs, one multiply-add counted as 2 FLOPs.
  Counted per leaf module from the observed shapes:

  - ``Conv2d``: ``2 * (C_in / groups) * k_h * k_w * out.numel()``, plus
    ``out.numel()`` when the conv has a bias.
  - ``Linear``: ``2 * in_features * out.numel()``, plus ``out.numel()`` for the
    bias (so ``Linear(i, o)`` costs ``2*i*o + o``).
  - ``BatchNorm``: ``2 * out.numel()`` (normalisation folded into one
    scale-and-shift per element, as at inference).
  - element-wise activations (ReLU & co.): ``out.numel()``.
  - pooling layers: ``in.numel()`` (every input element is read once and
    compared or added).
  - ``LayerNorm`` / ``GroupNorm``: ``5 * out.numel()`` with an affine transform,
    ``4 * out.numel()`` without (mean, variance, normalise, scale and shift;
    fvcore's convention). Unlike BatchNorm it cannot be folded at inference.
  - a leaf module deriving from :class:`CountsOwnFlops` reports its own
    FLOPs; the zoo's ViT uses one for the attention matmuls, which are not
    modules (see :mod:`splitlearn.models.vit`).
  - everything else (``Flatten``, ``Identity``, ``Dropout``, unknown modules)
    and functional operations such as residual additions: 0. They are
    negligible next to convolutions and linear layers.
* ``activation_bytes_per_sample`` -- size of the stage's output when sent as
  float32, i.e. ``4 * numel``; this is what crosses the network at a cut.
* ``train_memory_bytes_per_sample`` -- bytes of the tensors autograd saves for
  backward during the stage's forward (measured with
  :func:`torch.autograd.graph.saved_tensors_hooks`, deduplicated by storage,
  parameters and buffers excluded). It uses the model's real dtype and also
  counts e.g. int64 max-pool indices. The stage input is included when the
  stage needs it for backward (a first conv does), matching what the device
  holding the stage must keep alive.
* ``input_saved_bytes_per_sample`` / ``output_saved_bytes_per_sample`` -- the
  part of the above that is the stage's input / output. Summing consecutive
  stages counts a boundary tensor twice when both neighbours save it, and
  does not count an output nobody saves although the device holds it until
  it is sent; :func:`segment_memory_bytes_per_sample` corrects both.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

# Activations cross the network as float32 regardless of the compute dtype.
FLOAT32_BYTES = 4

_ACTIVATIONS = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardswish,
)
_POOLS = (
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
)


class CountsOwnFlops(nn.Module):
    """A leaf module (no children) that reports its own forward FLOPs.

    Functional operations inside a module with children are invisible to the
    per-leaf counter of :meth:`SplittableModel.stage_costs`. Wrapping such an
    operation (e.g. the two matmuls of attention) in a leaf deriving from this
    class makes it countable.
    """

    def count_flops(self, inputs: tuple[Tensor, ...], output: Tensor) -> int:
        """Return the forward FLOPs (multiply-add = 2) of one call.

        Parameters
        ----------
        inputs : tuple[Tensor, ...]
            The positional arguments the module was called with.
        output : Tensor
            What it returned.

        Returns
        -------
        int
            FLOPs for the whole call (the profiler calls it with a batch of 1).
        """
        raise NotImplementedError


@dataclass(frozen=True)
class StageCost:
    """Per-sample cost of one stage (see the module docstring for conventions).

    Attributes
    ----------
    name : str
        Human-readable stage name, e.g. ``"stage0"``.
    params : int
        Trainable parameter count of the stage.
    flops_per_sample : int
        Forward FLOPs per sample (one multiply-add = 2 FLOPs).
    activation_bytes_per_sample : int
        Bytes of the stage's output tensor per sample, as float32.
    train_memory_bytes_per_sample : int
        Bytes saved for backward per sample inside this stage.
    input_saved_bytes_per_sample : int
        Part of ``train_memory_bytes_per_sample`` that is the stage's input
        (0 when unknown, e.g. for hand-made costs).
    output_saved_bytes_per_sample : int
        Part of ``train_memory_bytes_per_sample`` that is the stage's output
        (e.g. a final ReLU saves it; 0 when unknown).
    """

    name: str
    params: int
    flops_per_sample: int
    activation_bytes_per_sample: int
    train_memory_bytes_per_sample: int
    input_saved_bytes_per_sample: int = 0
    output_saved_bytes_per_sample: int = 0


def total_cost(costs: Sequence[StageCost], name: str = "total") -> StageCost:
    """Combine consecutive stages into a single cost.

    Parameters
    ----------
    costs : Sequence[StageCost]
        Consecutive stage costs, e.g. ``model.stage_costs()[:cut]`` for the
        client side of a cut.
    name : str, optional
        Name of the combined cost.

    Returns
    -------
    StageCost
        Parameters, FLOPs and training memory are summed; the activation size
        is that of the last stage, since only its output leaves the segment.

    Raises
    ------
    ValueError
        If ``costs`` is empty.
    """
    if not costs:
        raise ValueError("total_cost needs at least one StageCost")
    return StageCost(
        name=name,
        params=sum(c.params for c in costs),
        flops_per_sample=sum(c.flops_per_sample for c in costs),
        activation_bytes_per_sample=costs[-1].activation_bytes_per_sample,
        train_memory_bytes_per_sample=sum(
            c.train_memory_bytes_per_sample for c in costs
        ),
    )


def segment_memory_bytes_per_sample(costs: Sequence[StageCost]) -> int:
    """Bytes per sample a device running consecutive stages holds after its forward.

    That is what autograd keeps for the backward pass plus the segment's
    output (the smashed data, held until sent). Unlike summing
    ``train_memory_bytes_per_sample``, a tensor at an inner stage boundary
    that both neighbouring stages save is counted once: on one device it is
    one tensor. Pure arithmetic on the costs, so planners can use it without
    torch; ``tests/unit/test_zoo.py`` compares it with a measurement.

    Parameters
    ----------
    costs : Sequence[StageCost]
        Consecutive stage costs from :meth:`SplittableModel.stage_costs`, e.g.
        ``costs[:cut]`` for the client side of ``cut``.

    Returns
    -------
    int
        Bytes per sample.

    Raises
    ------
    ValueError
        If ``costs`` is empty.
    """
    if not costs:
        raise ValueError("segment_memory_bytes_per_sample needs at least one StageCost")
    total = sum(c.train_memory_bytes_per_sample for c in costs)
    for prev, nxt in zip(costs[:-1], costs[1:], strict=True):
        total -= min(prev.output_saved_bytes_per_sample, nxt.input_saved_bytes_per_sample)
    last = costs[-1]
    return total + max(0, last.activation_bytes_per_sample - last.output_saved_bytes_per_sample)


def check_dims(in_channels: int, image_size: int, num_classes: int) -> None:
    """Validate the common constructor arguments of splittable models.

    Parameters
    ----------
    in_channels : int
        Number of input channels, must be >= 1.
    image_size : int
        Height and width of the square input, must be >= 1.
    num_classes : int
        Number of output classes, must be >= 1.

    Raises
    ------
    ValueError
        If any argument is not a positive int.
    """
    for label, value in (
        ("in_channels", in_channels),
        ("image_size", image_size),
        ("num_classes", num_classes),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive int, got {value!r}")


class SplittableModel(nn.Module):
    """Ordered list of stages; cut k means stages [0, k) run on the client.

    Parameters
    ----------
    stages : Sequence[nn.Module]
        The stages, in execution order; at least two so that a cut exists.
    input_shape : tuple[int, int, int]
        Per-sample input shape ``(C, H, W)``.
    num_classes : int
        Number of output logits.
    """

    #: Whether the server's trunk trains this network faster with its 4-D activations
    #: channels-last (NHWC) than in PyTorch's standard layout: on CPU, oneDNN's
    #: convolution kernels favour it for most convolution stacks, not for all.
    #: Measured per network by ``python -m benchmarks trunk``.
    channels_last: bool = False

    def __init__(
        self,
        stages: Sequence[nn.Module],
        *,
        input_shape: tuple[int, int, int],
        num_classes: int,
    ) -> None:
        super().__init__()
        if len(stages) < 2:
            raise ValueError(f"need at least 2 stages to split, got {len(stages)}")
        self.stages = nn.ModuleList(stages)
        self.input_shape = tuple(input_shape)
        self.num_classes = num_classes
        # Subclasses may set readable names (e.g. "stem", "layer1") after
        # super().__init__(); empty means "stage<i>".
        self.stage_names: tuple[str, ...] = ()

    def forward(self, x: Tensor) -> Tensor:
        """Run all stages in order.

        Parameters
        ----------
        x : Tensor
            Input batch of shape ``(B, *input_shape)``.

        Returns
        -------
        Tensor
            Logits of shape ``(B, num_classes)``.
        """
        for stage in self.stages:
            x = stage(x)
        return x

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.stages)

    def stage_name(self, index: int) -> str:
        """Readable name of stage ``index`` (``stage_names`` or ``"stage<i>"``).

        Parameters
        ----------
        index : int
            Stage index in ``[0, num_stages)``.

        Returns
        -------
        str
            The name used in :class:`StageCost` and reports.
        """
        if len(self.stage_names) == self.num_stages:
            return self.stage_names[index]
        return f"stage{index}"

    @property
    def valid_cuts(self) -> list[int]:
        """Cuts leaving at least one stage on each side: ``1 .. num_stages-1``."""
        return list(range(1, self.num_stages))

    def check_cut(self, cut: object) -> int:
        """Validate a cut index.

        Parameters
        ----------
        cut : object
            Candidate cut; must be an integer (not bool) in :attr:`valid_cuts`.

        Returns
        -------
        int
            The cut as a plain ``int``.

        Raises
        ------
        ValueError
            If ``cut`` is not a valid cut; the message lists the valid cuts.
        """
        try:
            # operator.index accepts numpy ints but rejects floats and strings.
            index = None if isinstance(cut, bool) else operator.index(cut)
        except TypeError:
            index = None
        if index is None or index not in self.valid_cuts:
            raise ValueError(
                f"invalid cut {cut!r} for a model with {self.num_stages} stages; "
                f"valid cuts are {self.valid_cuts}"
            )
        return index

    def cut_shape(self, cut: int) -> tuple[int, ...]:
        """Per-sample shape of the activation crossing cut ``cut``.

        Parameters
        ----------
        cut : int
            A valid cut; the activation is the output of stage ``cut - 1``.

        Returns
        -------
        tuple[int, ...]
            Shape without the batch dimension.

        Raises
        ------
        ValueError
            If ``cut`` is not in :attr:`valid_cuts`.
        """
        cut = self.check_cut(cut)
        x = self._probe_input()
        with torch.no_grad(), _eval_mode(self):
            for stage in self.stages[:cut]:
                x = stage(x)
        return tuple(x.shape[1:])

    def stage_costs(self) -> list[StageCost]:
        """Profile every stage on one zero sample.

        Returns
        -------
        list[StageCost]
            One entry per stage, in order. See the module docstring for what
            is counted.
        """
        exclude = {t.untyped_storage().data_ptr() for t in self.parameters()}
        exclude |= {t.untyped_storage().data_ptr() for t in self.buffers()}
        x = self._probe_input()
        costs = []
        with _eval_mode(self):
            for index, stage in enumerate(self.stages):
                x, flops, memory, saved_in, saved_out = _profile_stage(stage, x, exclude)
                costs.append(
                    StageCost(
                        name=self.stage_name(index),
                        params=sum(
                            p.numel() for p in stage.parameters() if p.requires_grad
                        ),
                        flops_per_sample=flops,
                        activation_bytes_per_sample=FLOAT32_BYTES * x[0].numel(),
                        train_memory_bytes_per_sample=memory,
                        input_saved_bytes_per_sample=saved_in,
                        output_saved_bytes_per_sample=saved_out,
                    )
                )
                # The next stage sees a fresh leaf, as on the server side.
                x = x.detach().requires_grad_(x.is_floating_point())
        return costs

    def _probe_input(self) -> Tensor:
        """Return a batch of one zero sample on the model's device and dtype."""
        ref = next(self.parameters(), None)
        if ref is None:
            return torch.zeros(1, *self.input_shape)
        return torch.zeros(1, *self.input_shape, device=ref.device, dtype=ref.dtype)


@contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """Temporarily put ``module`` in eval mode, restoring each submodule's flag.

    Profiling must not update BatchNorm running statistics, and a plain
    ``train(was_training)`` would lose mixed per-submodule modes.
    """
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _leaf_flops(module: nn.Module, inp: Tensor, out: Tensor) -> int:
    """Forward FLOPs of one leaf module for the observed tensors (see module doc)."""
    if isinstance(module, nn.Conv2d):
        per_out = 2 * (module.in_channels // module.groups) * math.prod(
            module.kernel_size
        )
        return per_out * out.numel() + (out.numel() if module.bias is not None else 0)
    if isinstance(module, nn.Linear):
        bias = out.numel() if module.bias is not None else 0
        return 2 * module.in_features * out.numel() + bias
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return 2 * out.numel()
    if isinstance(module, _ACTIVATIONS):
        return out.numel()
    if isinstance(module, _POOLS):
        return inp.numel()
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm)):
        affine = getattr(module, "elementwise_affine", getattr(module, "affine", False))
        return (5 if affine else 4) * out.numel()
    return 0


def _profile_stage(
    stage: nn.Module, x: Tensor, exclude: set[int]
) -> tuple[Tensor, int, int, int, int]:
    """Run ``stage`` on ``x`` and measure FLOPs and bytes saved for backward.

    Returns
    -------
    tuple[Tensor, int, int, int, int]
        The stage output, its FLOPs, the saved-tensor bytes, and the saved
        bytes that are the input's and the output's storage. ``x`` must be a
        batch of one so that totals are per-sample.
    """
    flops: list[int] = []
    saved: dict[int, int] = {}

    def hook(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
        if isinstance(module, CountsOwnFlops):
            flops.append(module.count_flops(args, out))
        else:
            flops.append(_leaf_flops(module, args[0], out))

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    leaves = [m for m in stage.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        with (
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            out = stage(x)
    finally:
        for handle in handles:
            handle.remove()
    saved_in = saved.get(x.untyped_storage().data_ptr(), 0)
    saved_out = saved.get(out.untyped_storage().data_ptr(), 0)
    return out, sum(flops), sum(saved.values()), saved_in, saved_out
