"""A device's stages described for the web device runtime (``web/``: TypeScript, TensorFlow.js).

The web runtime trains a device's stages below the cut in a browser, as the split step
(``clients/steps/split.py``) trains them in PyTorch: forward, the gradient at the cut from
the trunk, backward, one ``torch.optim.SGD`` step. It runs an ordered list of layers, so
it can take stages built from ``nn.Sequential`` containers of the layers in
:data:`SUPPORTED` and nothing else: a module of any other class (a residual block, an
attention layer, a recurrent layer), or a supported one with settings the runtime does not
implement, is refused by name and position, as :mod:`splitlearn.runtimes` refuses what
ExecuTorch cannot train.

:func:`describe_stages` writes the description the runtime loads (JSON-ready):

- ``format``: :data:`FORMAT`;
- ``input_shape`` and ``output_shape``: one sample's shape, PyTorch's layout;
- ``layers``: in execution order, each with ``type`` (the layer types of :data:`SUPPORTED`;
  adaptive pools whose input divides evenly become fixed pools), ``name`` (its module's
  state-dict prefix), ``module`` (its PyTorch class) and its hyperparameters;
- ``state``: every parameter and floating-point buffer under its state-dict key, encoded
  by :func:`encode_tensor` in PyTorch's layout (NCHW activations, OIHW conv weights; the
  runtime converts to TensorFlow.js's NHWC / HWIO itself);
- ``counters``: BatchNorm's ``num_batches_tracked``.

:func:`device_parts` names the stages a phone trains at a cut: the head ``[0, cut)`` and,
for a protocol that keeps a tail on the device, the tail ``[tail, n)``, each keyed by the
model's stage indices so that the phone's trained state loads back as it came.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

#: The description's format, checked by the runtime.
FORMAT = "splitlearn.web.stages/1"
#: The PyTorch modules the web runtime runs (``nn.Sequential`` containers are walked).
SUPPORTED = ("Conv2d", "BatchNorm2d", "ReLU", "ReLU6", "MaxPool2d", "AvgPool2d",
             "AdaptiveMaxPool2d", "AdaptiveAvgPool2d", "Flatten", "Linear", "Dropout",
             "Identity")


class WebRefusal(ValueError):
    """The web runtime cannot run a layer of the stages; the message names it."""


def encode_tensor(tensor: Tensor) -> dict[str, Any]:
    """Encode a tensor as ``{"shape": [...], "data": base64 of little-endian float32}``."""
    values = tensor.detach().cpu().contiguous().to(torch.float32).numpy()
    return {"shape": list(values.shape),
            "data": base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")}


def decode_tensor(encoded: Mapping[str, Any]) -> Tensor:
    """Decode :func:`encode_tensor`'s encoding (and the runtime's) to a float32 tensor."""
    raw = base64.b64decode(encoded["data"])
    values = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    return torch.from_numpy(values.copy()).reshape(list(encoded["shape"]))


def state_from_web(state: Mapping[str, Any]) -> dict[str, Tensor]:
    """Return the runtime's ``state()`` (``{"tensors", "counters"}``) as a state dict."""
    out = {key: decode_tensor(value) for key, value in state["tensors"].items()}
    out.update({key: torch.tensor(int(count), dtype=torch.long)
                for key, count in state.get("counters", {}).items()})
    return out


def stages_refusal(stages: nn.Module | Sequence[nn.Module],
                input_shape: Sequence[int]) -> str | None:
    """Return why the web runtime cannot train ``stages`` (None: it can).

    Parameters
    ----------
    stages : nn.Module or sequence of nn.Module
        The device's stages (``split(model, cut)[0]``, or the stages themselves).
    input_shape : sequence of int
        One sample's input shape, e.g. ``model.input_shape``.
    """
    try:
        _layers(_sequential(stages), tuple(input_shape))
    except WebRefusal as refusal:
        return str(refusal)
    return None


def device_parts(model: Any, cut: int, tail: int | None
                 ) -> list[tuple[nn.Module, tuple[int, ...]]]:
    """Return the stages a phone trains at ``cut``, each with one sample's input shape.

    Parameters
    ----------
    model : SplittableModel
        The network (its ``stages``, ``input_shape`` and ``cut_shape``).
    cut : int
        The device's head is ``[0, cut)``.
    tail : int or None
        The first stage of a tail the device keeps (U-shaped), or None.

    Returns
    -------
    list of (nn.Module, tuple of int)
        ``nn.Sequential`` containers whose state-dict keys are ``"<stage index>.…"``.
    """
    def part(first: int, last: int) -> nn.Module:
        return nn.Sequential(OrderedDict((str(i), model.stages[i]) for i in range(first, last)))

    parts = [(part(0, cut), tuple(model.input_shape))]
    if tail is not None:
        parts.append((part(tail, len(model.stages)), tuple(model.cut_shape(tail))))
    return parts


def describe_stages(stages: nn.Module | Sequence[nn.Module],
                    input_shape: Sequence[int]) -> dict[str, Any]:
    """Describe ``stages`` for the web runtime (the format is this module's docstring).

    Parameters
    ----------
    stages : nn.Module or sequence of nn.Module
        The device's stages (``split(model, cut)[0]``, or the stages themselves): their
        state-dict keys are the description's.
    input_shape : sequence of int
        One sample's input shape, e.g. ``model.input_shape``.

    Returns
    -------
    dict
        The description, ready for ``json.dumps``.

    Raises
    ------
    WebRefusal
        If a layer is not one the runtime runs; the message names its position and class.
    """
    module = _sequential(stages)
    layers, output_shape = _layers(module, tuple(input_shape))
    state: dict[str, Any] = {}
    counters: dict[str, int] = {}
    for key, value in module.state_dict().items():
        if key.endswith("num_batches_tracked"):
            counters[key] = int(value)
        else:
            state[key] = encode_tensor(value)
    return {"format": FORMAT, "input_shape": list(input_shape),
            "output_shape": list(output_shape), "layers": layers, "state": state,
            "counters": counters}


def _sequential(stages: nn.Module | Sequence[nn.Module]) -> nn.Module:
    return stages if isinstance(stages, nn.Module) else nn.Sequential(*stages)


def _leaves(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """Return the modules to run in order: ``nn.Sequential`` walked, others leaves."""
    if type(module) is nn.Sequential:
        out: list[tuple[str, nn.Module]] = []
        for name, child in module.named_children():
            out += _leaves(child, f"{prefix}.{name}" if prefix else name)
        return out
    return [(prefix, module)]


def _layers(module: nn.Module, shape: tuple[int, ...]) -> tuple[list[dict[str, Any]],
                                                                  tuple[int, ...]]:
    """Each leaf's description, its shape checked; raises :class:`WebRefusal`."""
    layers = []
    for index, (name, leaf) in enumerate(_leaves(module, "")):
        cls = type(leaf).__name__

        def refuse(why: str, index: int = index, name: str = name, cls: str = cls) -> WebRefusal:
            return WebRefusal(f"the web runtime cannot run layer {index} ({name or 'the stage'}: "
                              f"{cls}): {why}")

        if cls not in SUPPORTED or type(leaf).__module__.split(".")[0] != "torch":
            raise refuse(f"it runs only {', '.join(SUPPORTED)}, in nn.Sequential containers")
        for param in leaf.parameters(recurse=False):
            if param.dtype != torch.float32:
                raise refuse(f"its parameters are {param.dtype}, the runtime's are float32")
        spec, shape = _describe(leaf, shape, refuse)
        layers.append({"type": spec.pop("type", cls), "name": name, "module": cls, **spec})
    return layers, shape


def _describe(leaf: nn.Module, shape: tuple[int, ...], refuse: Any) -> tuple[dict[str, Any],
                                                                              tuple[int, ...]]:
    """One supported layer's hyperparameters and output shape (one sample)."""

    def spatial(kind: str) -> tuple[int, int, int]:
        if len(shape) != 3:
            raise refuse(f"{kind} needs (C, H, W) inputs, gets {list(shape)}")
        return shape[0], shape[1], shape[2]

    def out_size(size: int, kernel: int, stride: int, pad: int) -> int:
        out = (size + 2 * pad - kernel) // stride + 1
        if out < 1:
            raise refuse(f"its output would be empty for inputs {list(shape)}")
        return out

    if isinstance(leaf, nn.Conv2d):
        channels, height, width = spatial("a convolution")
        if channels != leaf.in_channels:
            raise refuse(f"{leaf.in_channels} input channels, the inputs have {channels}")
        if isinstance(leaf.padding, str):
            raise refuse(f"padding={leaf.padding!r}; the runtime takes explicit padding")
        if leaf.groups != 1 or tuple(leaf.dilation) != (1, 1) or leaf.padding_mode != "zeros":
            raise refuse(f"groups={leaf.groups}, dilation={tuple(leaf.dilation)}, "
                         f"padding_mode={leaf.padding_mode!r}; the runtime runs groups=1, "
                         "dilation=1, zero padding")
        (kh, kw), (sh, sw), (ph, pw) = leaf.kernel_size, leaf.stride, leaf.padding
        return ({"in_channels": leaf.in_channels, "out_channels": leaf.out_channels,
                 "kernel_size": [kh, kw], "stride": [sh, sw], "padding": [ph, pw],
                 "bias": leaf.bias is not None},
                (leaf.out_channels, out_size(height, kh, sh, ph), out_size(width, kw, sw, pw)))
    if isinstance(leaf, nn.BatchNorm2d):
        channels, _, _ = spatial("BatchNorm2d")
        if channels != leaf.num_features:
            raise refuse(f"{leaf.num_features} features, the inputs have {channels} channels")
        return ({"num_features": leaf.num_features, "eps": leaf.eps, "momentum": leaf.momentum,
                 "affine": leaf.affine, "track_running_stats": leaf.track_running_stats},
                shape)
    if isinstance(leaf, (nn.MaxPool2d, nn.AvgPool2d)):
        _, height, width = spatial("a pool")
        kernel, stride, pad = (_pair(leaf.kernel_size), _pair(leaf.stride or leaf.kernel_size),
                               _pair(leaf.padding))
        if leaf.ceil_mode:
            raise refuse("ceil_mode=True; the runtime rounds down")
        if isinstance(leaf, nn.MaxPool2d):
            if _pair(leaf.dilation) != (1, 1) or leaf.return_indices:
                raise refuse("dilation or return_indices; the runtime runs neither")
            if pad[0] != pad[1]:
                raise refuse(f"padding={list(pad)}; the runtime pads max pools equally")
        elif pad != (0, 0) or leaf.divisor_override is not None:
            raise refuse("padding or divisor_override; the runtime's average pools have neither")
        return ({"kernel_size": list(kernel), "stride": list(stride), "padding": list(pad)},
                (shape[0], out_size(height, kernel[0], stride[0], pad[0]),
                 out_size(width, kernel[1], stride[1], pad[1])))
    if isinstance(leaf, (nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool2d)):
        channels, height, width = spatial("a pool")
        if isinstance(leaf, nn.AdaptiveMaxPool2d) and leaf.return_indices:
            raise refuse("return_indices; the runtime does not return them")
        target = _pair(leaf.output_size)
        out_h, out_w = (height if target[0] is None else target[0],
                        width if target[1] is None else target[1])
        if height % out_h or width % out_w:
            raise refuse(f"pools {height}x{width} to {out_h}x{out_w}: the runtime runs "
                         "adaptive pools whose windows are equal (the input a multiple of the "
                         "output)")
        kernel = [height // out_h, width // out_w]
        kind = "MaxPool2d" if isinstance(leaf, nn.AdaptiveMaxPool2d) else "AvgPool2d"
        return ({"type": kind, "kernel_size": kernel, "stride": kernel, "padding": [0, 0]},
                (channels, out_h, out_w))
    if isinstance(leaf, nn.Flatten):
        if leaf.start_dim != 1 or leaf.end_dim != -1:
            raise refuse(f"start_dim={leaf.start_dim}, end_dim={leaf.end_dim}; the runtime "
                         "flattens all but the batch dimension")
        return {}, (int(np.prod(shape)),)
    if isinstance(leaf, nn.Linear):
        if len(shape) != 1 or shape[0] != leaf.in_features:
            raise refuse(f"{leaf.in_features} input features, the inputs are {list(shape)}")
        return ({"in_features": leaf.in_features, "out_features": leaf.out_features,
                 "bias": leaf.bias is not None}, (leaf.out_features,))
    if isinstance(leaf, nn.Dropout):
        return {"p": float(leaf.p)}, shape
    return {}, shape  # ReLU, ReLU6, Identity: elementwise or nothing


def _pair(value: Any) -> tuple[Any, Any]:
    return (value, value) if not isinstance(value, (tuple, list)) else (value[0], value[1])
