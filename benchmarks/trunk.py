"""The trunk's step by activation layout: ``python -m benchmarks trunk``.

For each network at the cut its config names (``conf/model/NAME.yaml``), on the dataset
it is meant for, one training step of the trunk as the split session takes it
(:func:`server.sessions.split.train_on_batch`: forward from the cut, cross-entropy, the
gradient at the cut and its check, the optimiser's step). Twice: with
the activations entering the trunk's stages in PyTorch's standard layout (NCHW) and
channels-last (NHWC), in interleaved blocks after a warm-up step each, on one intra-op
thread (the trunk's default, ``dataplane.trunk_threads``). The median milliseconds per
step go to ``trunk.csv`` and ``trunk.json`` in the run folder with a bar plot of the
speed-up (``trunk.png``); the last line printed is JSON with every network's ratio.
A network whose activations at its cut are not images (a ViT's tokens) has no layout
to choose and is listed, not timed.

The ratio is what :attr:`~splitlearn.models.SplittableModel.channels_last` records for
each network: which layout its trunk uses unless ``dataplane.channels_last`` says.
"""

from __future__ import annotations

import copy
import csv
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from protocols import compose_config
from server.sessions.split import train_on_batch
from server.trunk import Trunk
from splitlearn.config import to_object
from splitlearn.models import SplittableModel
from splitlearn.models.factory import build_model_from_config

#: Each network on the dataset it is meant for (the image size and channels follow).
CASES: tuple[tuple[str, str], ...] = (
    ("cnn", "digits"), ("lenet5", "mnist"), ("resnet", "cifar10"), ("resnet18", "cifar10"),
    ("vgg11_bn", "cifar10"), ("mobilenetv2", "cifar10"), ("densenet121", "cifar10"),
    ("vit", "cifar10"),
)
LAYOUTS = ("standard", "channels_last")

Batch = tuple[Tensor, Tensor]


def cut_batches(model: SplittableModel, cut: int, batch: int, *, count: int = 8,
                seed: int = 0) -> list[Batch]:
    """Return ``count`` batches of what devices send at ``cut``: random inputs, bottom run."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        acts = torch.rand(batch, *model.input_shape, generator=generator)
        with torch.no_grad():
            for stage in model.stages[:cut]:
                acts = stage(acts)
        batches.append((acts, torch.randint(0, model.num_classes, (batch,),
                                            generator=generator)))
    return batches


@dataclass(frozen=True)
class TrunkStepTime:
    """One network's trunk step in both layouts."""

    model: str
    dataset: str
    cut: int
    batch: int
    standard_ms: float
    channels_last_ms: float
    model_prefers_channels_last: bool

    @property
    def speedup(self) -> float:
        """Standard over channels-last time: above 1, channels-last is faster."""
        return self.standard_ms / self.channels_last_ms


def time_layouts(name: str, dataset: str, overrides: Sequence[str], *, steps: int,
                 blocks: int = 2) -> TrunkStepTime | str:
    """Median ms per trunk step of ``model=name`` in each layout, ``steps`` each.

    A network whose activations at the cut are not 4-D gets a sentence saying so instead.
    """
    cfg = compose_config([f"model={name}", f"dataset={dataset}", *overrides])
    model = build_model_from_config(to_object(cfg.model), to_object(cfg.dataset), seed=cfg.seed)
    cut, batch, options = cfg.model.cut, cfg.strategy.batch_size, cfg.strategy
    [(acts, labels)] = cut_batches(model, cut, batch, count=1, seed=cfg.seed)
    if acts.dim() != 4:
        return (f"{name} cut {cut} on {dataset}: its activations {tuple(acts.shape[1:])} "
                "are not images; the layout does not apply")
    trunks = {layout: Trunk(copy.deepcopy(model), lr=options.lr, momentum=options.momentum,
                            channels_last=layout == "channels_last") for layout in LAYOUTS}
    times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    per_block = max(1, steps // blocks)
    for block in range(blocks):
        for layout, trunk in trunks.items():
            if block == 0:
                train_on_batch(trunk, cut, acts, labels)  # warm-up: oneDNN picks its kernels
            for _ in range(per_block):
                started = time.perf_counter()
                train_on_batch(trunk, cut, acts, labels)
                times[layout].append(time.perf_counter() - started)
    return TrunkStepTime(
        model=name, dataset=dataset, cut=cut, batch=batch,
        standard_ms=statistics.median(times["standard"]) * 1e3,
        channels_last_ms=statistics.median(times["channels_last"]) * 1e3,
        model_prefers_channels_last=model.channels_last,
    )


def bench_trunk(overrides: Sequence[str], *, steps: int = 10,
                models: Sequence[str] | None = None, out_dir: Path | None = None
                ) -> list[TrunkStepTime]:
    """Time every network's trunk step in both layouts; write the rows, the plot, a JSON line."""
    torch.set_num_threads(1)
    out_dir = out_dir or Path("outputs/bench") / time.strftime("trunk-%Y-%m-%d-%H-%M-%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, dataset in CASES:
        if models and name not in models:
            continue
        row = time_layouts(name, dataset, overrides, steps=steps)
        if isinstance(row, str):
            print(row, flush=True)
            continue
        rows.append(row)
        agrees = (row.speedup > 1) == row.model_prefers_channels_last
        print(f"{name} cut {row.cut} on {dataset}, batch {row.batch}: standard "
              f"{row.standard_ms:.1f} ms, channels-last {row.channels_last_ms:.1f} ms per step "
              f"({row.speedup:.2f}x); the model prefers "
              f"{'channels-last' if row.model_prefers_channels_last else 'standard'}"
              f"{'' if agrees else ' (not the faster one here)'}", flush=True)
    write_rows(rows, out_dir / "trunk.csv")
    (out_dir / "trunk.json").write_text(json.dumps(
        [{**asdict(r), "speedup": r.speedup} for r in rows], indent=2))
    plot_speedups(rows, out_dir / "trunk.png")
    print(f"results in {out_dir}")
    print(json.dumps({"channels_last_speedup": {r.model: round(r.speedup, 3) for r in rows}}))
    return rows


def write_rows(rows: Sequence[TrunkStepTime], path: Path) -> None:
    """One CSV row per network, with the speed-up."""
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*asdict(rows[0]), "speedup"])
        writer.writeheader()
        writer.writerows({**asdict(r), "speedup": round(r.speedup, 4)} for r in rows)


def plot_speedups(rows: Sequence[TrunkStepTime], path: Path) -> None:
    """Bars: channels-last's speed-up per network, the networks that use it filled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 3.6))
    for i, row in enumerate(rows):
        ax.bar(i, row.speedup, color="tab:blue" if row.model_prefers_channels_last else "white",
               edgecolor="tab:blue")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(rows)), [f"{r.model}\ncut {r.cut}" for r in rows], fontsize=8)
    ax.set_ylabel("standard / channels-last time")
    ax.set_title("Trunk step with channels-last activations (filled: the model's default)")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
