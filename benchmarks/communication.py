"""Bytes per training sample for every protocol against FedAvg, as the model and the data grow.

``python -m benchmarks communication [overrides ...]``

Two parts:

* measured against the closed forms (:mod:`splitlearn.communication`): each
  protocol (and SplitFed with int8 both ways) trains 2 rounds on digits with 3
  clients through the shipped apps in this process, for the SmallCNN and the
  ResNet-style network at 16x16; measured bytes (data plane and weights, both
  ways) per training sample against the formula; the error is reported;
* who wins where: the closed forms from 10 to 100,000 samples per client (one
  local epoch) for the SmallCNN on digits, the ResNet-style network at 32x32 and
  ResNet-18 at 32x32 (CIFAR-10's shape), at cut 1 (and ResNet-18 at cut 4),
  with the sample count above which FedAvg moves fewer bytes than SplitFed.

Writes ``communication.json`` and ``communication.png``; the last line is JSON
with the worst closed-form error and the break-even sample counts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from protocols import compose_config, protocol_named, tail_cut_of
from splitlearn.calibration import communication_sizes
from splitlearn.communication import ClosedForm, Sizes, bytes_per_sample, fedavg_break_even

#: Protocols measured and drawn: (label, strategy, uplink, downlink).
PROTOCOLS = (
    ("FedAvg", "fedavg", "none", "none"),
    ("SplitFed v2 / SL", "splitfed_v2", "none", "none"),
    ("SplitFed v2, int8", "splitfed_v2", "int8", "int8"),
    ("U-shaped", "ushaped", "none", "none"),
    ("local loss", "local_loss", "none", "none"),
)
#: Networks whose runs are checked against the closed forms.
MEASURED = (("SmallCNN, digits 8x8", ("model=cnn",)),
            ("ResNet, digits 16x16", ("model=resnet", "dataset.image_size=16")))
#: Networks drawn from the closed forms.
DRAWN = (("SmallCNN, digits 8x8", ("model=cnn",)),
         ("ResNet, 32x32", ("model=resnet", "dataset.image_size=32")),
         ("ResNet-18, CIFAR-10 32x32", ("model=resnet18", "dataset=cifar10")),
         ("ResNet-18 at cut 4", ("model=resnet18", "dataset=cifar10", "model.cut=4")))
SAMPLES = [round(10 ** (1 + 0.25 * i)) for i in range(17)]  # 10 .. 100,000


def protocol_sizes(overrides: Sequence[str]) -> Sizes:
    """Return the model's sizes at its cut for ``overrides``.

    The device side's bytes are those of the state its device step ships (with an
    auxiliary head or a tail where the protocol's step keeps one).
    """
    from splitlearn.config import run_spec, to_object
    from splitlearn.models.factory import build_model_from_config

    cfg = compose_config(list(overrides))
    model = build_model_from_config(to_object(cfg.model), to_object(cfg.dataset))
    sizes = communication_sizes(model, cfg.model.cut, tail_cut=tail_cut_of(cfg.strategy, model))
    step = protocol_named(cfg.strategy.name).client(
        model, run_spec(cfg, host_flops_per_s=0.0), cut=cfg.model.cut)
    shipped = step.state()
    return dataclasses.replace(
        sizes, client_param_bytes=sum(t.numel() * t.element_size() for t in shipped.values()),
        client_arrays=len(shipped))


def closed_form(strategy: str) -> ClosedForm:
    """Return the closed form of protocol ``strategy`` (its registry entry's)."""
    return protocol_named(strategy).capabilities.bytes_per_sample


def measure(network: str, extra: Sequence[str], overrides: Sequence[str]) -> list[dict]:
    """Train each protocol briefly; return measured and predicted bytes per sample."""
    from experiments.local import run_local

    rows = []
    for label, strategy, up, down in PROTOCOLS:
        run = [*extra, f"strategy={strategy}", f"dataplane.compression.uplink={up}",
               f"dataplane.compression.downlink={down}", "num_clients=3",
               "strategy.num_rounds=2", "strategy.local_epochs=1", "logger=none", *overrides]
        cfg = compose_config(run)
        rounds = run_local(cfg, concurrency=1).history[1:]
        examples = sum(r["examples"] for r in rounds)
        measured = sum(r["bytes_up"] + r["bytes_down"] for r in rounds) / examples
        predicted = bytes_per_sample(
            closed_form(strategy), protocol_sizes(run),
            samples_per_client=examples / len(rounds) / 3, local_epochs=1, uplink=up,
            downlink=down)["total"]
        # int8's closed form is a bound: the zeros after ReLU cost a bit each, not a byte.
        bound = "int8" in (up, down)
        rows.append({"network": network, "protocol": label, "measured": measured,
                     "closed_form": predicted, "error": measured / predicted - 1,
                     "upper_bound": bound})
        print(f"{network:>22} {label:>18}: measured {measured:9.1f} B/sample, closed form "
              f"{predicted:9.1f}{' (upper bound)' if bound else ''} "
              f"({measured / predicted - 1:+.2%})", flush=True)
    return rows


def curves(overrides: Sequence[str]) -> dict:
    """Closed-form bytes per sample by samples per client, per network and protocol."""
    table: dict = {}
    for network, extra in DRAWN:
        sizes = {label: protocol_sizes([*extra, f"strategy={strategy}", *overrides])
                 for label, strategy, _, _ in PROTOCOLS}
        table[network] = {
            "break_even_samples": fedavg_break_even(sizes["SplitFed v2 / SL"]),
            "break_even_samples_int8": fedavg_break_even(sizes["SplitFed v2 / SL"],
                                                         uplink="int8", downlink="int8"),
            "curves": {label: [bytes_per_sample(closed_form(strategy), sizes[label],
                                                samples_per_client=n, uplink=up,
                                                downlink=down)["total"]
                               for n in SAMPLES]
                       for label, strategy, up, down in PROTOCOLS},
        }
    return table


def plot(table: dict, measured: Sequence[dict], path: Path) -> None:
    """One log-log panel per network; measured runs as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table), figsize=(5.2 * len(table), 4.2), squeeze=False)
    for ax, (network, row) in zip(axes[0], table.items(), strict=True):
        for label, values in row["curves"].items():
            ax.plot(SAMPLES, values, label=label)
        ax.axvline(row["break_even_samples"], color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("training samples per client and round")
        ax.set_ylabel("bytes per training sample")
        ax.set_title(f"{network}\nFedAvg cheaper above {row['break_even_samples']:,.0f}")
    for point in measured:
        if point["network"] in table:
            ax = axes[0][list(table).index(point["network"])]
            ax.scatter([1437 / 3], [point["measured"]], color="black", s=12, zorder=3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_communication(overrides: Sequence[str], *, out_dir: Path | None = None) -> dict:
    """Check the closed forms on real runs, draw who wins where; print and return both."""
    out_dir = out_dir or Path("outputs/bench") / time.strftime("communication-%Y-%m-%d-%H-%M-%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    measured = [row for network, extra in MEASURED for row in measure(network, extra, overrides)]
    table = curves(overrides)
    for network, row in table.items():
        print(f"{network}: FedAvg moves fewer bytes than SplitFed above "
              f"{row['break_even_samples']:,.0f} training samples per client and round "
              f"({row['break_even_samples_int8']:,.0f} against SplitFed with int8)")
    (out_dir / "communication.json").write_text(json.dumps(
        {"measured": measured, "closed_form": table, "samples_per_client": SAMPLES}, indent=2))
    plot(table, measured, out_dir / "communication.png")
    print(f"results in {out_dir}")
    exact = [r for r in measured if not r["upper_bound"]]
    summary = {"max_abs_closed_form_error": max(abs(r["error"]) for r in exact),
               "bounds_hold": all(r["error"] <= 0 for r in measured if r["upper_bound"]),
               "break_even_samples": {n: round(r["break_even_samples"]) for n, r in table.items()}}
    print(json.dumps(summary))
    return summary
