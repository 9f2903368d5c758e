"""The model zoo's cost table: ``python -m benchmarks.zoo [--out docs/zoo.md]``.

For every registered network and every valid cut it reports what the client
side costs: parameters, share of the forward FLOPs, smashed bytes per sample
sent at the cut, and training memory per sample -- the estimate planners use
(:func:`~splitlearn.models.base.segment_memory_bytes_per_sample`, from one
profiled sample) next to a measurement (:func:`measure_segment_memory`, bytes
the client's forward on a batch leaves allocated, divided by the batch).

Two tables: a small-input one (default 32x32x3, 10 classes, with the
measurement) and, unless ``--no-imagenet``, the ImageNet case (224x224x3,
1000 classes, estimates only: the FLOPs of ResNet-18 there are the published
1.8 GMACs). Markdown goes to stdout and, with ``--out``, to a file.
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from splitlearn.models import MODELS, ZOO, SplittableModel, build_model, total_cost
from splitlearn.models.base import segment_memory_bytes_per_sample
from splitlearn.stages import split

COMMAND = "python -m benchmarks.zoo --out docs/zoo.md"


def measure_segment_memory(segment: nn.Module, x: torch.Tensor) -> float:
    """Measure bytes per sample a forward pass leaves allocated, in train mode.

    Runs ``segment`` on a copy of ``x`` under ``torch.profiler`` with memory
    profiling and sums every allocation minus every free: what stays is the
    tensors autograd saved for backward plus the output (and the input copy
    if it was saved). This is independent of the estimate, which counts
    saved tensors with ``saved_tensors_hooks`` on a single sample in eval mode.

    Parameters
    ----------
    segment : nn.Module
        E.g. the bottom of :func:`splitlearn.stages.split`; left in its mode.
    x : Tensor
        A batch of inputs ``(B, ...)``.

    Returns
    -------
    float
        Net allocated bytes divided by ``B``.
    """
    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # frees from earlier work must not land inside the window
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = segment(x.clone())
    net = sum(event.self_cpu_memory_usage for event in prof.events())
    del out
    return net / x.shape[0]


def _bytes(n: float) -> str:
    """Human-readable binary size."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _count(n: float) -> str:
    """Human-readable count (parameters, FLOPs)."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def network_rows(
    name: str,
    model: SplittableModel,
    *,
    measure_batch: int,
    seed: int = 0,
) -> list[list[str]]:
    """Markdown rows for ``model``: one per valid cut.

    Parameters
    ----------
    name : str
        Registry name shown in the first column.
    model : SplittableModel
        The network (train mode is set for the measurement).
    measure_batch : int
        Batch for the memory measurement; 0 skips it.
    seed : int, optional
        Seed of the random measurement batch.

    Returns
    -------
    list[list[str]]
        Cells per row.
    """
    costs = model.stage_costs()
    total_flops = sum(c.flops_per_sample for c in costs)
    rows = []
    model.train()
    gen = torch.Generator().manual_seed(seed)
    for cut in model.valid_cuts:
        client = total_cost(costs[:cut])
        estimate = segment_memory_bytes_per_sample(costs[:cut])
        row = [
            name,
            str(cut),
            model.stage_name(cut - 1),
            _count(client.params),
            f"{100 * client.flops_per_sample / total_flops:.1f}%",
            _bytes(client.activation_bytes_per_sample),
            _bytes(estimate),
        ]
        if measure_batch:
            x = torch.randn(measure_batch, *model.input_shape, generator=gen)
            measured = measure_segment_memory(split(model, cut)[0], x)
            row.append(f"{_bytes(measured)} ({measured / estimate:.3f})")
        rows.append(row)
    return rows


def summary_row(name: str, model: SplittableModel) -> list[str]:
    """One summary line: stages, parameters, forward MACs and FLOPs per sample."""
    costs = model.stage_costs()
    flops = sum(c.flops_per_sample for c in costs)
    params = sum(p.numel() for p in model.parameters())
    return [
        name,
        str(model.num_stages),
        f"{params:,}",
        _count(flops / 2),
        _count(flops),
        ", ".join(model.stage_names) if model.stage_names else "",
    ]


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Render a markdown table."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def zoo_section(
    names: Sequence[str],
    *,
    channels: int,
    size: int,
    classes: int,
    measure_batch: int,
) -> str:
    """Markdown for one input size: a summary table and the per-cut table."""
    summaries, rows = [], []
    for name in names:
        model = build_model(
            name, in_channels=channels, image_size=size, num_classes=classes, seed=0
        )
        summaries.append(summary_row(name, model))
        rows += network_rows(name, model, measure_batch=measure_batch)
    header = [
        "network",
        "cut",
        "client ends after",
        "client params",
        "client FLOPs share",
        "smashed bytes/sample",
        "client train memory/sample",
    ]
    if measure_batch:
        header.append(f"measured, batch {measure_batch} (ratio)")
    summary = table(
        ["network", "stages", "params", "MACs/sample", "FLOPs/sample", "stage names"], summaries
    )
    title = f"### {size}x{size}x{channels} input, {classes} classes"
    return f"{title}\n\n{summary}\n\n{table(header, rows)}\n"


PREAMBLE = """\
Six published networks written in the project (torchvision does not install beside the
CPU torch here), each built for 8x8 to 224x224 inputs and any number of classes, and
selected like the default networks: `python -m experiments.run model=resnet18
dataset.image_size=32`. Each `conf/model/NAME.yaml` holds a default cut and the reason
for it; `model.options` passes constructor keywords (e.g. `+model.options.depth=4` for
the ViT).

| name | network: stages (cut k keeps stages [0, k) on the client) | below 64x64 |
| --- | --- | --- |
| `lenet5` | LeNet-5 (ReLU, max pool): C1, C3, C5, F6, output | padded convs < 32 |
| `vgg11_bn` | VGG-11-BN: 5 conv blocks, 3 classifier layers | fewer pools, 512 wide |
| `resnet18` | ResNet-18: stem, layer1-4, head | 3x3 stride-1 stem |
| `mobilenetv2` | MobileNetV2: stem, 7 bottleneck groups, conv_last, head | fewer strides |
| `densenet121` | DenseNet-121: stem, 4 dense blocks + transitions, head | 3x3 stride-1 stem |
| `vit` | ViT (dim 192, 6 blocks, 3 heads): patch embedding, blocks, head | smaller patches |

At 224x224 with 1000 classes the parameter counts equal torchvision's (ResNet-18
11,689,512; VGG-11-BN 132,868,840; MobileNetV2 3,504,872; DenseNet-121 7,978,856) and
the counted multiply-adds match the published ones within 5%: ResNet-18 1.82 G
(published 1.8 G), VGG-11 7.63 G (7.6 G), MobileNetV2 0.31 G (0.30 G), DenseNet-121
2.86 G (2.87 G); LeNet-5 at 32x32 is 852,370 FLOPs, checked against a hand count
(`tests/unit/test_zoo.py`).

**Any other network** is split with `torch.fx` where a single tensor crosses:

```python
from splitlearn.models.autosplit import auto_split, find_cut_points
points = find_cut_points(net, example_batch)  # node name, op, shape, bytes of each
model = auto_split(net, example_batch)         # a SplittableModel cut at every point
model = auto_split(net, example_batch, cuts=[points[2].node, points[5].node])  # 3 stages
```

Cut points never fall inside a residual block (the skip connection still needs the
block input), nor between two uses of a shared weight; stages hold the network's own
modules, so `split(model, cut)`, the costs and the planners work unchanged, and outputs
match the original exactly. A network that cannot be traced (Python control flow on
tensor values) gets an `AutoSplitError` naming the operation, the source line and the
module; `leaf_modules=` keeps such a module whole inside one stage.

**Batch norm** running statistics are buffers of the stage that owns the layer: they
train on the side that runs it, are part of `bottom_state` (so FedAvg averages the
client-side ones with the weights) and never leave the server for trunk stages.

## Tables

Per sample; cut `k` puts stages `[0, k)` on the client. *Client FLOPs share*: the
client's part of the whole forward pass (FLOPs counted per layer from the observed
shapes, one multiply-add = 2 FLOPs; MACs = FLOPs / 2; attention matmuls counted by the
ViT's `AttentionCore`). *Smashed bytes*: the activation sent at the cut, as float32.
*Client train memory*: bytes the client holds after its forward pass -- tensors saved
for backward plus the smashed activation -- estimated from one profiled sample
(`segment_memory_bytes_per_sample`; summing the stages' `train_memory_bytes_per_sample`
instead counts a boundary tensor twice when both neighbours save it and leaves out the
smashed output: 8% under to 15% over for ResNet-18). *Measured*: bytes left allocated by a
train-mode forward of a random batch (`torch.profiler` memory events), divided by the
batch; the ratio measured / estimate is in brackets. The estimate is profiled in eval
mode, so it misses the few train-only tensors (BatchNorm batch statistics, dropout
masks): ratios are >= 1 and within 4% at 8x8 to 32x32."""


def main(argv: Sequence[str] | None = None) -> str:
    """Print (and optionally write) the zoo tables; return the markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=32, help="input height and width")
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--measure-batch", type=int, default=8, help="0 skips measuring")
    parser.add_argument("--models", default=",".join([*ZOO, *MODELS]), help="comma separated")
    parser.add_argument("--no-imagenet", action="store_true", help="skip the 224x224 table")
    parser.add_argument("--out", type=Path, help="also write the markdown here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as clients run: one intra-op thread each (engine.torch_threads)
    names = [n for n in args.models.split(",") if n]
    start = time.perf_counter()
    parts = [
        "# Model zoo: cost per network and cut",
        f"Generated by `{COMMAND}` (torch {torch.__version__}, CPU).",
        PREAMBLE,
        zoo_section(
            names,
            channels=args.channels,
            size=args.size,
            classes=args.classes,
            measure_batch=args.measure_batch,
        ),
    ]
    if not args.no_imagenet:
        parts.append(
            zoo_section(
                [n for n in names if n in ZOO], channels=3, size=224, classes=1000, measure_batch=0
            )
        )
    markdown = "\n\n".join(parts) + "\n"
    print(markdown)
    if args.out:
        args.out.write_text(markdown)
    print(f"<!-- {math.ceil(time.perf_counter() - start)} s -->")
    return markdown


if __name__ == "__main__":
    main()
