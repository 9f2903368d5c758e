"""Split an arbitrary ``nn.Module`` into stages with ``torch.fx``.

:func:`auto_split` traces a module symbolically, finds every point of its
forward pass where exactly one tensor is alive (the *single crossing tensor*)
and cuts the graph there into stages. The result is a
:class:`~splitlearn.models.SplittableModel`, so :func:`splitlearn.stages.split`,
the cost profile and the rest of the project use it unchanged.

What is a cut point
-------------------
Walk the traced graph in execution order. After the node producing ``c``, the
position is a cut point when

* ``c`` is the only value computed from the input that a later node still
  reads (inside a residual block the block input is still needed by the skip
  connection, so no cut point exists there; between blocks there is one);
* ``c`` is a tensor with the input's batch size as its first dimension;
* some computation is left after it (the last node is not a cut point);
* no parameter or buffer is used on both sides (tied weights cannot be owned
  by both client and server);
* the next stage does not modify ``c`` in place (a stage receives the
  activation as a leaf tensor, and autograd forbids in-place ops on those).

Values that do not depend on the input (parameters read with ``get_attr``,
constants) do not count as crossing: each stage that needs one reads it
itself.

Stages are :class:`torch.fx.GraphModule` objects that hold the *original*
submodules and parameters (nothing is copied), so the split model computes
exactly what the original computes, and training either trains both.

Limits (those of ``torch.fx``)
------------------------------
* Python control flow on tensor values cannot be traced; :class:`AutoSplitError`
  names the value, the source line and the module being traced. Declaring
  that module a leaf (``leaf_modules=``) keeps it whole inside one stage.
* Flags read at trace time are frozen into the graph, e.g.
  ``F.dropout(x, training=self.training)``; use ``nn.Dropout`` modules.
* The cost profile counts modules (convolutions, linear layers, norms...);
  functional calls such as ``F.relu`` or ``F.conv2d`` count 0 FLOPs.
* Tracing patches ``nn.Module.__call__`` for the whole process while it runs:
  traces here take turns (two at once left the patch in place for good), and a
  module another thread calls during a trace fails. Trace before starting
  threads that run modules (:func:`~splitlearn.models.factory.build_model_from_config`
  traces a configured module once per process).
"""

from __future__ import annotations

import math
import operator
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, fx, nn

from splitlearn.models.base import FLOAT32_BYTES, CountsOwnFlops, SplittableModel

_TORCH_DIR = str(Path(torch.__file__).parent)
_THIS_FILE = str(Path(__file__))
#: One trace (and probe) at a time per process: a trace saves and restores torch's
#: process-wide patches, and a probe running modules must not meet another's patch.
_TRACING = threading.Lock()

_INPLACE_OPERATORS = frozenset(
    {
        operator.iadd,
        operator.isub,
        operator.imul,
        operator.itruediv,
        operator.ifloordiv,
        operator.imod,
        operator.ipow,
        operator.imatmul,
        operator.iand,
        operator.ior,
        operator.ixor,
        operator.ilshift,
        operator.irshift,
        operator.setitem,
    }
)


class AutoSplitError(ValueError):
    """A module cannot be traced or split; the message says where and why."""


@dataclass(frozen=True)
class CutPoint:
    """A place where one tensor crosses, i.e. where the model can be cut.

    Attributes
    ----------
    node : str
        Name of the ``torch.fx`` node producing the crossing tensor; pass it
        to :func:`auto_split` (``cuts=``) to cut there.
    op : str
        What produces it: a module path (``"layer1.1.relu2"``), a function
        (``"add"``) or a method (``".flatten"``).
    shape : tuple[int, ...]
        Per-sample shape of the crossing tensor (batch dimension dropped).
    activation_bytes_per_sample : int
        Its size per sample as float32, what crosses the network.
    """

    node: str
    op: str
    shape: tuple[int, ...]
    activation_bytes_per_sample: int


class AutoSplitModel(SplittableModel):
    """A :class:`SplittableModel` whose stages come from :func:`auto_split`.

    Parameters
    ----------
    stages : Sequence[nn.Module]
        The stage graph modules, in order.
    input_shape : tuple[int, ...]
        Per-sample input shape.
    num_classes : int
        Size of the output's last dimension.
    cut_points : Sequence[CutPoint]
        The cut points between the stages: cut ``k`` is ``cut_points[k - 1]``.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        *,
        input_shape: tuple[int, ...],
        num_classes: int,
        cut_points: Sequence[CutPoint],
    ) -> None:
        super().__init__(stages, input_shape=input_shape, num_classes=num_classes)  # type: ignore[arg-type]
        self.cut_points = tuple(cut_points)
        self.stage_names = (*(p.node for p in cut_points), "output")


def find_cut_points(
    module: nn.Module,
    example_input: Tensor,
    *,
    leaf_modules: Sequence[type[nn.Module]] = (),
) -> list[CutPoint]:
    """List every point of ``module``'s forward pass where it can be cut.

    Parameters
    ----------
    module : nn.Module
        Any module whose ``forward`` takes one tensor.
    example_input : Tensor
        A batch to run once (in eval mode, without gradients, so BatchNorm
        statistics are untouched) to learn the shapes.
    leaf_modules : Sequence[type[nn.Module]], optional
        Module classes to keep whole (not traced into), besides ``torch.nn``'s.

    Returns
    -------
    list[CutPoint]
        In execution order; empty if the module cannot be cut anywhere.

    Raises
    ------
    AutoSplitError
        If ``module`` cannot be traced (the message names the operation) or
        does not take exactly one input.
    """
    return _analyse(module, example_input, leaf_modules).cut_points


def auto_split(
    module: nn.Module,
    example_input: Tensor,
    *,
    cuts: Sequence[str] | None = None,
    leaf_modules: Sequence[type[nn.Module]] = (),
) -> AutoSplitModel:
    """Split ``module`` into stages at single-tensor cut points.

    Parameters
    ----------
    module : nn.Module
        Any module whose ``forward`` takes one tensor and returns one tensor.
        Its parameters are shared with the result, not copied.
    example_input : Tensor
        A batch of inputs, shape ``(B, *input_shape)``; run once in eval mode
        without gradients.
    cuts : Sequence[str] | None, optional
        Names of the cut points to cut at (:attr:`CutPoint.node`); default
        ``None`` cuts at every cut point.
    leaf_modules : Sequence[type[nn.Module]], optional
        Module classes to keep whole (not traced into), besides ``torch.nn``'s;
        a module with data-dependent control flow can be declared a leaf.

    Returns
    -------
    AutoSplitModel
        ``len(cuts) + 1`` stages; ``input_shape`` is ``example_input``'s
        per-sample shape and ``num_classes`` the output's last dimension.

    Raises
    ------
    AutoSplitError
        If ``module`` cannot be traced (the message names the operation and
        the source line), has no cut point, or ``cuts`` names an unknown
        cut point (the message lists the valid ones).
    """
    analysis = _analyse(module, example_input, leaf_modules)
    points = analysis.cut_points
    if not points:
        raise AutoSplitError(
            f"{type(module).__name__} has no point where a single tensor crosses; "
            "nothing to split"
        )
    if cuts is not None:
        by_name = {p.node: p for p in points}
        unknown = [name for name in cuts if name not in by_name]
        if unknown or not cuts:
            raise AutoSplitError(
                f"unknown cut points {unknown}; valid cut points are {list(by_name)}"
            )
        wanted = set(cuts)
        points = [p for p in points if p.node in wanted]
    stages = _build_stages(analysis, [p.node for p in points])
    out = analysis.output_value
    return AutoSplitModel(
        stages,
        input_shape=tuple(example_input.shape[1:]),
        num_classes=int(out.shape[-1]),
        cut_points=points,
    )


# --------------------------------------------------------------------------- tracing


class _ControlFlowError(Exception):
    """Raised by the tracer when a traced value decides Python control flow."""

    def __init__(self, what: str, node: fx.Node, where: str, module_path: str) -> None:
        super().__init__(what)
        self.what = what
        self.node = node
        self.where = where
        self.module_path = module_path


class _Tracer(fx.Tracer):
    """``fx.Tracer`` that keeps extra leaves and reports control flow precisely."""

    def __init__(self, leaf_modules: Sequence[type[nn.Module]]) -> None:
        super().__init__()
        # CountsOwnFlops leaves stay whole so that the cost profile sees them.
        self.extra_leaves = (CountsOwnFlops, *leaf_modules)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self.extra_leaves):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def to_bool(self, obj: fx.Proxy) -> bool:
        raise _ControlFlowError(
            "Python control flow on a tensor value (bool())",
            obj.node,
            _user_frame(traceback.extract_stack()),
            self._current_module(),
        )

    def iter(self, obj: fx.Proxy) -> Iterator:
        raise _ControlFlowError(
            "iteration over a tensor value",
            obj.node,
            _user_frame(traceback.extract_stack()),
            self._current_module(),
        )

    def _current_module(self) -> str:
        stack = getattr(self, "module_stack", None)
        if not stack:
            return ""
        value = next(reversed(stack.values()))
        # torch keeps (qualified path, module class) per entry.
        path, kind = value if isinstance(value, tuple) else ("", value)
        name = getattr(kind, "__name__", str(kind))
        return f"{path} ({name})" if path else name


def _trace(module: nn.Module, leaf_modules: Sequence[type[nn.Module]]) -> fx.GraphModule:
    """Trace ``module``; turn every tracing failure into an :class:`AutoSplitError`."""
    tracer = _Tracer(leaf_modules)
    name = type(module).__name__
    try:
        graph = tracer.trace(module)
    except _ControlFlowError as err:
        inside = f" inside {err.module_path}" if err.module_path else ""
        raise AutoSplitError(
            f"torch.fx cannot trace {name}: {err.what} of `{_describe(err.node)}`"
            f"{inside} at {err.where}. Rewrite it without Python branching on tensor "
            "values (e.g. torch.where), or pass that module's class in leaf_modules= "
            "to keep it whole inside one stage."
        ) from None
    except Exception as err:
        last = next(reversed(tracer.graph.nodes), None) if hasattr(tracer, "graph") else None
        after = f"; last traced operation `{_describe(last)}`" if last is not None else ""
        where = _user_frame(traceback.extract_tb(err.__traceback__))
        raise AutoSplitError(
            f"torch.fx cannot trace {name}: {type(err).__name__}: {err} (at {where}{after})"
        ) from err
    return fx.GraphModule(tracer.root, graph, name)


def _user_frame(frames: traceback.StackSummary) -> str:
    """Describe the innermost frame outside torch and this file: ``file:line in f: `code```."""
    for frame in reversed(frames):
        if frame.filename.startswith(_TORCH_DIR) or frame.filename == _THIS_FILE:
            continue
        code = f": `{frame.line.strip()}`" if frame.line else ""
        return f"{frame.filename}:{frame.lineno} in {frame.name}{code}"
    return "an unknown location"


def _describe(node: fx.Node) -> str:
    """Compact ``name = op(args)`` text for error messages and reports."""
    args = ", ".join(str(a) for a in node.args)
    if node.op == "call_module":
        return f"{node.name} = self.{node.target}({args})"
    if node.op == "call_function":
        module = getattr(node.target, "__module__", None) or ""
        prefix = "operator." if module.lstrip("_") == "operator" else ""
        return f"{node.name} = {prefix}{_op_name(node)}({args})"
    if node.op == "call_method":
        first, *rest = node.args or ("?",)
        return f"{node.name} = {first}.{node.target}({', '.join(map(str, rest))})"
    return f"{node.name} ({node.op} {node.target})"


def _op_name(node: fx.Node) -> str:
    """Short name of what produces ``node``: module path, function or .method."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "call_method":
        return f".{node.target}"
    target = node.target
    return getattr(target, "__name__", str(target))


# --------------------------------------------------------------------------- analysis


@dataclass
class _Analysis:
    """A traced module and what :func:`_analyse` learnt about its graph."""

    gm: fx.GraphModule
    nodes: list[fx.Node]
    input_node: fx.Node
    dependent: set[fx.Node]  # nodes whose value depends on the input
    cut_points: list[CutPoint]
    boundaries: dict[str, int]  # cut point name -> index of the last node before the cut
    output_value: Tensor


@contextmanager
def _eval_no_grad(*modules: nn.Module) -> Iterator[None]:
    """Eval mode and no grad for a probe run, restoring every submodule's flag."""
    flags = [(m, m.training) for root in modules for m in root.modules()]
    for root in modules:
        root.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, flag in flags:
            m.training = flag


def _probe(gm: fx.GraphModule, module: nn.Module, x: Tensor) -> tuple[dict[fx.Node, Any], Any]:
    """Run ``gm`` on ``x`` and record every node's value (tensors as meta only)."""
    values: dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            if isinstance(result, Tensor):
                values[n] = (tuple(result.shape), result.dtype)
            return result

    with _eval_no_grad(module, gm):
        out = Recorder(gm).run(x)
    return values, out


def _analyse(
    module: nn.Module, example_input: Tensor, leaf_modules: Sequence[type[nn.Module]]
) -> _Analysis:
    """Trace ``module``, probe its shapes and find its cut points."""
    if not isinstance(example_input, Tensor) or example_input.dim() < 1:
        raise AutoSplitError("example_input must be a tensor with a batch dimension")
    with _TRACING:  # the probe runs the graph's modules: no trace may patch them meanwhile
        gm = _trace(module, leaf_modules)
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(inputs) != 1:
            raise AutoSplitError(
                f"auto_split needs a forward with exactly one input; {type(module).__name__} "
                f"takes {[n.target for n in inputs]}"
            )
        values, out = _probe(gm, module, example_input)
    nodes = list(gm.graph.nodes)
    if not isinstance(out, Tensor) or out.dim() < 1:
        raise AutoSplitError(
            f"auto_split needs a forward returning one tensor; {type(module).__name__} "
            f"returns {type(out).__name__}"
        )
    input_node = inputs[0]
    dependent = _dependent_nodes(nodes, input_node)
    uses = _state_uses(gm, nodes, dependent)
    points = []
    boundaries = {}
    batch = example_input.shape[0]
    for c, index in _single_crossings(nodes, dependent):
        meta = values.get(c)
        if meta is None or not meta[0] or meta[0][0] != batch:
            continue
        if not _disjoint_state(nodes, index, dependent, uses):
            continue
        if any(_mutates(user, c, gm) for user in c.users):
            continue
        boundaries[c.name] = index
        shape = meta[0][1:]
        points.append(
            CutPoint(
                node=c.name,
                op=_op_name(c),
                shape=shape,
                activation_bytes_per_sample=FLOAT32_BYTES * math.prod(shape),
            )
        )
    return _Analysis(gm, nodes, input_node, dependent, points, boundaries, out)


def _dependent_nodes(nodes: list[fx.Node], input_node: fx.Node) -> set[fx.Node]:
    """Nodes whose value is computed from the input (in graph order)."""
    dependent = {input_node}
    for node in nodes:
        if node.op != "output" and any(a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    return dependent


def _single_crossings(
    nodes: list[fx.Node], dependent: set[fx.Node]
) -> Iterator[tuple[fx.Node, int]]:
    """Yield ``(c, i)``: after node ``i``, ``c`` is the only live input-derived value.

    Only the first such position per ``c`` is yielded (usually ``c`` itself).
    Constants (input-independent nodes) are ignored: stages recompute or read
    them. At least one input-derived node must follow before the output.
    """
    position = {node: index for index, node in enumerate(nodes)}
    last_use = {
        node: max((position[u] for u in node.users), default=-1) for node in dependent
    }
    compute = [n for n in nodes if n in dependent and n.op != "placeholder"]
    last_compute = position[compute[-1]] if compute else -1
    live: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    for index, node in enumerate(nodes):
        if node not in dependent or index >= last_compute:
            continue
        live = {n for n in live if last_use[n] > index}
        if last_use[node] > index:
            live.add(node)
        if len(live) == 1:
            (crossing,) = live
            if crossing.op != "placeholder" and crossing not in seen:
                seen.add(crossing)
                yield crossing, index


def _state_uses(
    gm: fx.GraphModule, nodes: list[fx.Node], dependent: set[fx.Node]
) -> dict[fx.Node, set[int]]:
    """Ids of the parameters/buffers each input-derived node reads (via constants too)."""
    direct: dict[fx.Node, set[int]] = {}
    for node in nodes:
        ids: set[int] = set()
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            ids = {id(t) for t in (*sub.parameters(), *sub.buffers())}
        elif node.op == "get_attr":
            value = _fetch_attr(gm, str(node.target))
            if isinstance(value, Tensor):
                ids = {id(value)}
        # Constants pass what they read on to their (eventual) input-derived users.
        for arg in node.all_input_nodes:
            if arg not in dependent:
                ids |= direct.get(arg, set())
        direct[node] = ids
    return {node: direct[node] for node in nodes if node in dependent}


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _disjoint_state(
    nodes: list[fx.Node], index: int, dependent: set[fx.Node], uses: dict[fx.Node, set[int]]
) -> bool:
    """Return whether no parameter or buffer is read both before and after ``index``."""
    before: set[int] = set()
    after: set[int] = set()
    for i, node in enumerate(nodes):
        if node in dependent:
            (before if i <= index else after).update(uses[node])
    return not (before & after)


def _mutates(user: fx.Node, value: fx.Node, gm: fx.GraphModule) -> bool:
    """Return whether ``user`` modifies ``value`` in place."""
    if not user.args or user.args[0] is not value:
        return False
    if user.op == "call_module":
        return bool(getattr(gm.get_submodule(str(user.target)), "inplace", False))
    if user.op == "call_method":
        name = str(user.target)
        return name.endswith("_") and not name.endswith("__")
    if user.op == "call_function":
        name = getattr(user.target, "__name__", "")
        return (
            user.target in _INPLACE_OPERATORS
            or user.kwargs.get("inplace") is True
            or (name.endswith("_") and not name.endswith("__"))
        )
    return False


# --------------------------------------------------------------------------- stages


def _build_stages(analysis: _Analysis, cut_nodes: Sequence[str]) -> list[fx.GraphModule]:
    """Cut the traced graph after each named node; one GraphModule per stage."""
    nodes = analysis.nodes
    by_name = {n.name: n for n in nodes}
    output = next(n for n in nodes if n.op == "output")
    stages = []
    start, lo = analysis.input_node, nodes.index(analysis.input_node)
    for index, name in enumerate([*cut_nodes, None]):
        end = by_name[name] if name is not None else None
        hi = analysis.boundaries[name] if name is not None else len(nodes)
        segment = [
            n
            for n in nodes[lo + 1 : hi + 1]
            if n in analysis.dependent and n.op not in ("placeholder", "output")
        ]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {start: graph.placeholder(start.name)}
        lookup = _make_lookup(graph, env, analysis.dependent)
        for node in segment:
            env[node] = graph.node_copy(node, lookup)
        if end is not None:
            graph.output(env[end])
        else:
            graph.output(fx.graph.map_arg(output.args[0], lookup))
        graph.lint()
        stages.append(fx.GraphModule(analysis.gm, graph, f"Stage{index}"))
        if end is not None:
            start, lo = end, hi
    return stages


def _make_lookup(
    graph: fx.Graph, env: dict[fx.Node, fx.Node], dependent: set[fx.Node]
) -> Callable[[fx.Node], fx.Node]:
    """Map an original node to its copy in ``graph``, copying constants on demand."""

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            if node in dependent:  # cannot happen for a valid cut point
                raise AutoSplitError(f"value {node.name} crosses a cut point")
            env[node] = graph.node_copy(node, lookup)
        return env[node]

    return lookup

