"""Privacy attacks on a trained split model: ``python -m experiments.attack NAME [overrides ...]``.

Each command trains the configured protocol (``strategy=``, SplitFed v2 by
default) with the shipped strategy, ClientApp and trunk in this process
(:mod:`experiments.local`: the in-process channel, no engine start-up), then
attacks the final model the way the server could:

``inversion``
    A decoder trained on (released activations, input) pairs from auxiliary
    data reconstructs the target client's inputs from one release each, and from the
    average of 10 linked releases; a white-box search through the client layers
    (the server holds them) does the same; prints MSE and SSIM.
``dcor``
    Distance correlation between the target client's inputs and what it releases
    (the plain sample statistic and the bias-corrected estimate of its square).
``label_leak``
    Norm and direction attacks on the cut-layer gradients the trunk returns for
    the target client's samples; prints the one-vs-rest ROC AUC of each.
``table``
    The privacy-utility table: no noise, activation noise at several levels and
    DP-SGD on the client layers; each row with epsilon, test accuracy and the
    three attacks. Prints markdown (and writes it with ``--out``).
``poison``
    Not a privacy attack: devices that lie to the shared trunk (:mod:`experiments.poison`).
    The default job (20 rounds of SplitFed v2 on digits, 10 devices) once without
    attackers and once per attack and count of liars (``--attackers``), with the defences
    on (the defaults, plus any ``--defence`` overrides) and off; prints a line per run and
    the table, and writes ``poison.csv``, ``poison.json``, ``poison.md`` and
    ``poison.png`` into ``--out``. ``ATTACK_DEFAULTS`` do not apply to it.

The target is client 0's training partition; the attacker's auxiliary data is
everything else it could plausibly hold (the other clients' partitions and the
test split), so the inversion is a strong, same-distribution attack.
Attack defaults: the small CNN cut after its first stage, 10 rounds of 1 local
epoch (the documented experiment runs 20 rounds of 2). Extra arguments are
Hydra overrides, e.g. ``privacy=activation_gaussian privacy.noise_multiplier=0.03``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from protocols import compose_config, protocol_named, tail_cut_of  # noqa: E402
from splitlearn.attacks import (  # noqa: E402
    InversionResult,
    bias_corrected_distance_correlation,
    cut_layer_gradients,
    direction_attack_auc,
    distance_correlation,
    invert,
    one_vs_rest_norm_auc,
    optimise_inversion,
    ssim,
)
from splitlearn.config import AggregationConfig, PrivacyConfig, to_object  # noqa: E402
from splitlearn.data import client_dataset, held_out_dataset  # noqa: E402
from splitlearn.models import SplittableModel  # noqa: E402
from splitlearn.privacy import GaussianActivationMechanism  # noqa: E402
from splitlearn.privacy.labels import randomized_labels  # noqa: E402
from splitlearn.privacy.mechanism import clip_per_sample  # noqa: E402

#: Overrides applied before the user's: fast, offline, the shallowest (most exposed) cut.
ATTACK_DEFAULTS = (
    "logger=none",
    "model=cnn",
    "model.cut=1",
    "strategy.num_rounds=10",
    "strategy.local_epochs=1",
)
#: ``--quick``: minutes become seconds (2 rounds; a decoder of 5 epochs, a white-box search
#: of 100 steps). Numbers move, the ordering of the rows should not; the full setting is
#: what docs/how-to/privacy.md reports.
QUICK_OVERRIDES = ("strategy.num_rounds=2",)
QUICK_DECODER_EPOCHS = 5
QUICK_WHITEBOX_STEPS = 100
#: Decoder epochs of the inversion attack in the full setting.
DECODER_EPOCHS = 60
#: Clip norm for activations at cut 1 of the small CNN: about the median row norm
#: of the trained network on digits (measured 9-11), so clipping only trims outliers.
ACTIVATION_CLIP_NORM = 10.0
#: Activation noise levels of the table (sigma; noise std = sigma * C per coordinate).
TABLE_SIGMAS = (0.01, 0.03, 0.1, 0.3)
#: DP-SGD row of the table: (sigma, per-sample gradient clip norm).
TABLE_DPSGD = (1.0, 1.0)
#: NoPeek row of the table: the weight of dCor(inputs, activations) in the device's loss.
TABLE_NOPEEK = 10.0
#: Label-DP row of the table: randomised response at this epsilon.
TABLE_LABEL_EPSILON = 1.0
#: U-shaped only: noise on the returned gradient (sigma; clip privacy.gradient_clip_norm).
TABLE_GRADIENT_NOISE = 1.0
#: Linked-release inversion: releases of one example the server averages before decoding.
LINKED_RELEASES = 10
#: White-box inversion: Adam steps of the search in input space.
WHITEBOX_STEPS = 300
#: SecAgg+ / DP-FedAvg row of the table (the uploaded weights): (sigma, update clip norm).
TABLE_UPDATE_DP = (1.0, 0.5)
TARGET_CLIENT = 0


@dataclass(frozen=True)
class AttackData:
    """The target client's samples and the attacker's auxiliary images."""

    targets: Tensor
    target_labels: Tensor
    aux: Tensor


def load_attack_data(cfg: DictConfig) -> AttackData:
    """Client 0's training partition as targets; all other digits as auxiliary data."""
    dataset, partitioner = to_object(cfg.dataset), to_object(cfg.partitioner)

    def partition(pid: int) -> tuple[Tensor, Tensor]:
        data = client_dataset(dataset, partitioner, seed=cfg.seed, partition_id=pid,
                              num_partitions=cfg.num_clients)
        return data.tensors[0], data.tensors[1]

    targets, labels = partition(TARGET_CLIENT)
    test = held_out_dataset(dataset, seed=cfg.seed)
    others = [partition(pid)[0] for pid in range(cfg.num_clients) if pid != TARGET_CLIENT]
    return AttackData(targets, labels, torch.cat([*others, test.tensors[0]]))


def train(cfg: DictConfig) -> tuple[SplittableModel, list[dict[str, float]], float]:
    """Train in process; return the final joined model, the history and the seconds taken."""
    from experiments.local import run_local

    started = time.perf_counter()
    result = run_local(cfg, concurrency=2)  # two clients at a time, as Ray runs them on 2 cores
    return result.model, result.history, time.perf_counter() - started


def release_fn(
    model: SplittableModel, cut: int, settings: PrivacyConfig, generator: torch.Generator
) -> Callable[[Tensor], Tensor]:
    """Return what the client sends for a batch of inputs (fresh noise on every call)."""
    bottom = nn.Sequential(*list(model.stages)[:cut]).eval()
    mechanism = None
    if settings.name == "activation_gaussian":
        mechanism = GaussianActivationMechanism(
            clip_norm=settings.clip_norm, noise_multiplier=settings.noise_multiplier,
            generator=generator,
        )

    @torch.no_grad()
    def release(inputs: Tensor) -> Tensor:
        activations = bottom(inputs)
        return activations if mechanism is None else mechanism(activations)

    return release


def linked_inversion(
    model: SplittableModel, cut: int, settings: PrivacyConfig, data: AttackData,
    single: InversionResult, *, decoder_epochs: int, generator: torch.Generator,
) -> float:
    """SSIM of the decoder attack on the average of ``LINKED_RELEASES`` releases per example.

    The average of k Gaussian releases of a clipped row is distributed exactly as one
    release at sigma / sqrt(k) (:func:`splitlearn.attacks.linked_releases` averages
    them; this draws the average at once, k times cheaper). Without activation noise
    every release is the same row, so linking them adds nothing.
    """
    if settings.name != "activation_gaussian":
        return single.ssim
    averaged = dataclasses.replace(
        settings, noise_multiplier=settings.noise_multiplier / math.sqrt(LINKED_RELEASES))
    return invert(release_fn(model, cut, averaged, generator), aux_inputs=data.aux,
                  targets=data.targets, epochs=decoder_epochs, generator=generator).ssim


def noiseless_release(
    model: SplittableModel, cut: int, settings: PrivacyConfig
) -> Callable[[Tensor], Tensor]:
    """Return the deterministic part of the release (the device's layers, then clipping).

    What a white-box attacker differentiates through: it holds the weights and C.
    """
    bottom = nn.Sequential(*list(model.stages)[:cut]).eval().requires_grad_(False)
    if settings.name != "activation_gaussian":
        return bottom
    return lambda inputs: clip_per_sample(bottom(inputs), max_norm=settings.clip_norm)


def attack(
    cfg: DictConfig,
    *,
    which: Sequence[str] = ("inversion", "dcor", "label_leak"),
    data: AttackData | None = None,
    decoder_epochs: int = DECODER_EPOCHS,
    whitebox_steps: int = WHITEBOX_STEPS,
) -> dict[str, float | str]:
    """Train with ``cfg``, run the chosen attacks; return one table row.

    Returns
    -------
    dict[str, float | str]
        ``privacy``, ``sigma``, ``clip``, ``epsilon`` (inf without privacy),
        ``test_accuracy``, ``train_s`` and, per attack run, ``ssim`` and ``mse``,
        ``dcor``, ``auc_norm`` and ``auc_direction``.
    """
    torch.set_num_threads(cfg.engine.torch_threads)
    data = data or load_attack_data(cfg)
    model, history, train_s = train(cfg)
    settings: PrivacyConfig = to_object(cfg.privacy)
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    release = release_fn(model, cfg.model.cut, settings, generator)
    nopeek = f" + NoPeek {settings.nopeek_weight:g}" if settings.nopeek_weight else ""
    labels = f" + label RR eps {settings.label_epsilon:g}" if settings.label_epsilon else ""
    if settings.gradient_noise_multiplier:
        labels += f" + gradient noise {settings.gradient_noise_multiplier:g}"
    weights = weights_defence(to_object(cfg.aggregation))
    row: dict[str, float | str] = {
        "privacy": settings.name + nopeek + labels + weights,
        "sigma": settings.noise_multiplier if settings.accounted else 0.0,
        "clip": settings.clip_norm if settings.accounted else math.inf,
        "epsilon": history[-1].get("epsilon", math.inf),
        # Client-level, on the uploaded weights (DP-FedAvg); inf: each device's weights reach
        # the server as they are.
        "update_epsilon": history[-1].get("update_epsilon", math.inf),
        "test_accuracy": history[-1]["test_accuracy"],
        "train_s": train_s,
    }
    if "inversion" in which:
        result = invert(
            release, aux_inputs=data.aux, targets=data.targets, epochs=decoder_epochs,
            generator=generator,
        )
        linked = linked_inversion(model, cfg.model.cut, settings, data, result,
                                  decoder_epochs=decoder_epochs, generator=generator)
        found = optimise_inversion(noiseless_release(model, cfg.model.cut, settings),
                                   release(data.targets), shape=tuple(data.targets.shape[1:]),
                                   steps=whitebox_steps)
        row |= {"ssim": result.ssim, "mse": result.mse, "ssim_linked": linked,
                "ssim_whitebox": float(ssim(found, data.targets).mean())}
    if "dcor" in which:
        released = release(data.targets)
        row["dcor"] = distance_correlation(data.targets, released)
        # Unbiased for dCor^2 and near 0 for independent samples: it still separates
        # noise levels where the plain statistic sits at its floor.
        row["dcor_corrected"] = bias_corrected_distance_correlation(data.targets, released)
        # The sample statistic is biased upwards: pairs shuffled out of order
        # (independent by construction) show the floor for this sample size.
        shuffled = torch.randperm(len(released), generator=generator)
        row["dcor_shuffled"] = distance_correlation(data.targets, released[shuffled])
    if "label_leak" in which:
        # The gradients come from the labels the device trains on (randomised under
        # label DP); the attacker is scored against the true ones.
        trained_on = data.target_labels
        if settings.label_epsilon:
            trained_on = randomized_labels(trained_on, epsilon=settings.label_epsilon,
                                           num_classes=model.num_classes, secret=cfg.seed + 2)
        grads = server_seen_gradients(cfg, model, release(data.targets), trained_on, settings,
                                      generator=generator)
        row["auc_norm"] = one_vs_rest_norm_auc(grads, data.target_labels)
        row["auc_direction"] = direction_attack_auc(
            grads, data.target_labels, generator=generator
        )
    return row


def weights_defence(aggregation: AggregationConfig) -> str:
    """Name the table row's defence of the uploaded weights ("" for none)."""
    text = " + SecAgg+" if aggregation.secure else ""
    if aggregation.clipped:
        text += (f" + DP-FedAvg sigma {aggregation.update_noise_multiplier:g} "
                 f"C {aggregation.update_clip_norm:g}")
    return text


def server_seen_gradients(
    cfg: DictConfig, model: SplittableModel, released: Tensor, labels: Tensor,
    settings: PrivacyConfig, *, generator: torch.Generator,
) -> Tensor:
    """Return the label-bearing gradient the server sees for each released row.

    Where the trunk holds the loss it is the gradient the trunk returns at the cut;
    in U-shaped training it is the gradient the device sends back at the trunk's
    features, noised as the device noises it (``privacy.gradient_noise_multiplier``).
    """
    stages = list(model.stages)
    cut = cfg.model.cut
    tail_cut = tail_cut_of(cfg.strategy, model)
    if tail_cut is None:
        return cut_layer_gradients(nn.Sequential(*stages[cut:]), released, labels)
    with torch.no_grad():
        features = nn.Sequential(*stages[cut:tail_cut])(released)
    grads = cut_layer_gradients(nn.Sequential(*stages[tail_cut:]), features, labels)
    if not settings.gradient_noise_multiplier:
        return grads
    mechanism = GaussianActivationMechanism(  # per-example rows, as the device clips them
        clip_norm=settings.gradient_clip_norm,
        noise_multiplier=settings.gradient_noise_multiplier, generator=generator)
    return mechanism(grads * len(labels)) / len(labels)


def table_configs(
    overrides: Sequence[str],
    *,
    sigmas: Sequence[float] = TABLE_SIGMAS,
    dpsgd: tuple[float, float] | None = TABLE_DPSGD,
    nopeek: float | None = TABLE_NOPEEK,
    label_epsilon: float | None = TABLE_LABEL_EPSILON,
    update_dp: tuple[float, float] | None = TABLE_UPDATE_DP,
    clip_norm: float = ACTIVATION_CLIP_NORM,
) -> list[DictConfig]:
    """One config per row: no noise, each activation sigma, DP-SGD, NoPeek, label DP, SecAgg+."""
    rows = [["privacy=none"]]
    rows += [
        ["privacy=activation_gaussian", f"privacy.clip_norm={clip_norm}",
         f"privacy.noise_multiplier={s}"]
        for s in sigmas
    ]
    if dpsgd is not None:
        rows.append(["privacy=dpsgd_client", f"privacy.noise_multiplier={dpsgd[0]}",
                     f"privacy.clip_norm={dpsgd[1]}"])
    protocol = protocol_named(compose_config([*ATTACK_DEFAULTS, *overrides]).strategy.name)
    caps = protocol.capabilities
    if nopeek is not None and caps.nopeek:
        rows.append(["privacy=none", f"privacy.nopeek_weight={nopeek}"])
    if label_epsilon is not None:
        rows.append(["privacy=none", f"privacy.label_epsilon={label_epsilon}"])
    if caps.device_tail is not None:  # the device returns a gradient: it can be noised
        rows.append(["privacy=none", f"privacy.gradient_noise_multiplier={TABLE_GRADIENT_NOISE}"])
    if update_dp is not None and caps.averages_device_weights:
        rows.append(["privacy=none", "aggregation.secure=true",
                     f"aggregation.update_noise_multiplier={update_dp[0]}",
                     f"aggregation.update_clip_norm={update_dp[1]}"])
    configs = []
    for row in rows:
        cfg = compose_config([*ATTACK_DEFAULTS, *row, *overrides])
        configs.append(cfg)
    return configs


def format_table(rows: Sequence[dict[str, float | str]], *, delta: float) -> str:
    """Markdown privacy-utility table."""
    header = (
        f"| privacy | sigma | C | epsilon (delta={delta:g}) | weights epsilon (client-level) | "
        f"test acc | inversion SSIM | inversion MSE | SSIM, {LINKED_RELEASES} linked releases | "
        "white-box SSIM | dCor | dCor² (bias-corrected) | label AUC (norm) | "
        "label AUC (direction) |\n"
        "| --- |" + " ---: |" * 13 + "\n"
    )

    def num(value: float | str, fmt: str) -> str:
        value = float(value)
        return "inf" if math.isinf(value) else format(value, fmt)

    lines = [
        f"| {r['privacy']} | {num(r['sigma'], 'g')} | {num(r['clip'], 'g')} | "
        f"{num(r['epsilon'], '.3g')} | {num(r['update_epsilon'], '.3g')} | "
        f"{num(r['test_accuracy'], '.3f')} | "
        f"{num(r['ssim'], '.3f')} | {num(r['mse'], '.4f')} | {num(r['ssim_linked'], '.3f')} | "
        f"{num(r['ssim_whitebox'], '.3f')} | {num(r['dcor'], '.3f')} | "
        f"{num(r['dcor_corrected'], '.3f')} | "
        f"{num(r['auc_norm'], '.3f')} | {num(r['auc_direction'], '.3f')} |"
        for r in rows
    ]
    return header + "\n".join(lines) + "\n"


def run_table(overrides: Sequence[str], *, out: Path | None = None,
              decoder_epochs: int = DECODER_EPOCHS, whitebox_steps: int = WHITEBOX_STEPS) -> str:
    """Train and attack every table row; print (and write) the markdown table."""
    started = time.perf_counter()
    configs = table_configs(overrides)
    data = load_attack_data(configs[0])
    rows = []
    for cfg in configs:
        row = attack(cfg, data=data, decoder_epochs=decoder_epochs,
                     whitebox_steps=whitebox_steps)
        rows.append(row)
        print(f"{row['privacy']:>20} sigma={row['sigma']:<5g} eps={float(row['epsilon']):<10.4g} "
              f"acc={float(row['test_accuracy']):.3f} ssim={float(row['ssim']):.3f} "
              f"(linked {float(row['ssim_linked']):.3f}, white-box "
              f"{float(row['ssim_whitebox']):.3f}) "
              f"dcor={float(row['dcor']):.3f} (corrected {float(row['dcor_corrected']):.3f}) "
              f"auc={float(row['auc_norm']):.3f}/"
              f"{float(row['auc_direction']):.3f} ({float(row['train_s']):.0f}s training)",
              flush=True)
    table = format_table(rows, delta=float(configs[1].privacy.delta))
    cfg = configs[0]
    footer = (
        f"\n{cfg.model.name} cut {cfg.model.cut}, {cfg.num_clients} clients, "
        f"{cfg.strategy.num_rounds} rounds x {cfg.strategy.local_epochs} local epoch(s); "
        f"{len(data.targets)} target samples (client {TARGET_CLIENT}), {len(data.aux)} "
        f"auxiliary; dCor of shuffled (independent) pairs: "
        f"{float(rows[0]['dcor_shuffled']):.3f}; {time.perf_counter() - started:.0f} s in all.\n"
    )
    print("\n" + table + footer, end="")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table + footer)
    return table


def run_single(name: str, overrides: Sequence[str], *, decoder_epochs: int = DECODER_EPOCHS,
               whitebox_steps: int = WHITEBOX_STEPS) -> dict[str, float | str]:
    """Train once with the overrides and run one attack; print its numbers."""
    cfg = compose_config([*ATTACK_DEFAULTS, *overrides])
    row = attack(cfg, which=(name,), decoder_epochs=decoder_epochs,
                 whitebox_steps=whitebox_steps)
    shown = {k: v for k, v in row.items() if k != "train_s"}
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in shown.items()))
    return row


def run_poison(args: argparse.Namespace, overrides: Sequence[str]) -> None:
    """Run the poisoning suite (:func:`experiments.poison.run_suite`) and print its table."""
    from experiments.poison import (
        ATTACKS,
        format_table,
        measure_cost,
        measure_step_cost,
        run_suite,
    )

    if args.cost:
        print("\n" + measure_step_cost(repeats=args.cost), end="")
        print("\n" + measure_cost(overrides, repeats=args.cost, concurrency=args.concurrency),
              end="")
        return
    attacks = args.attacks or list(ATTACKS)
    unknown = sorted(set(attacks) - set(ATTACKS))
    if unknown:
        raise SystemExit(f"unknown attacks {unknown}; known: {sorted(ATTACKS)} (Hydra "
                         "overrides go before --attacks and --attackers, which take a list)")
    rows = run_suite(attacks=attacks, attackers=args.attackers, overrides=overrides,
                     defence_overrides=args.defence, concurrency=args.concurrency, out=args.out)
    print("\n" + format_table(rows), end="")
    if args.out is not None:
        print(f"written to {args.out}/poison.{{csv,json,md,png}}")


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the attack name and its Hydra overrides; run it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=["inversion", "dcor", "label_leak", "table", "poison"])
    parser.add_argument("--out", type=Path,
                        help="table: also write the markdown to this file; poison: the folder "
                             "for its results")
    parser.add_argument("--attackers", type=int, nargs="+", default=[1, 2],
                        help="poison: counts of lying devices (default: 1 2)")
    parser.add_argument("--attacks", nargs="+", help="poison: the attacks (default: all)")
    parser.add_argument("--defence", action="append", default=[], metavar="OVERRIDE",
                        help="poison: one more override of the defences-on runs, e.g. "
                             "aggregation.robust=median (repeatable)")
    parser.add_argument("--concurrency", type=int, default=2,
                        help="poison: devices trained at once (default 2)")
    parser.add_argument("--cost", type=int, metavar="REPEATS",
                        help="poison: instead of the attacks, time trunk steps and honest "
                             "runs with the defences on, without the loss check and off, "
                             "interleaved REPEATS times")
    parser.add_argument("--quick", action="store_true",
                        help=f"{' '.join(QUICK_OVERRIDES)}, a {QUICK_DECODER_EPOCHS}-epoch "
                             f"decoder and {QUICK_WHITEBOX_STEPS} white-box steps: seconds, "
                             "not minutes")
    parser.add_argument("--decoder-epochs", type=int, help="inversion decoder's epochs")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (after --quick's)")
    args = parser.parse_intermixed_args(argv)  # overrides before or after the options
    overrides = [*(QUICK_OVERRIDES if args.quick else ()), *args.overrides]
    epochs = args.decoder_epochs or (QUICK_DECODER_EPOCHS if args.quick else DECODER_EPOCHS)
    if epochs < 1:
        parser.error(f"--decoder-epochs must be >= 1, got {epochs}")
    steps = QUICK_WHITEBOX_STEPS if args.quick else WHITEBOX_STEPS
    if args.name == "poison":
        run_poison(args, overrides)
    elif args.name == "table":
        run_table(overrides, out=args.out, decoder_epochs=epochs, whitebox_steps=steps)
    else:
        run_single(args.name, overrides, decoder_epochs=epochs, whitebox_steps=steps)


if __name__ == "__main__":
    main()
