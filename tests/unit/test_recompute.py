"""Activation recomputation on the device, its memory model, and the memory meter.

Recomputed training is held to plain training (gradients, weights, BatchNorm
buffers, dropout masks); the meter is held to the estimate it measures, and the
cost table to the stage costs it is built from.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from clients.memory import MemoryMeter, memory_saving_ratio
from clients.steps.base import ClientStep
from clients.steps.local_loss import LocalLossStep
from clients.steps.split import SplitStep
from clients.steps.ushaped import UShapedStep
from clients.steps.whole import WholeModelStep
from protocols.local_loss import LocalLossOptions
from protocols.ushaped import UShapedOptions
from splitlearn.calibration import TRAIN_TO_FORWARD_FLOPS, client_train_memory_bytes, cut_costs
from splitlearn.config import RunSpec
from splitlearn.models import SplittableModel
from splitlearn.models.base import segment_memory_bytes_per_sample
from splitlearn.models.lean import MaskReLU, mask_cut_relu
from tests.conftest import digits_like_model, fixed_batches
from tests.helpers import plain_spec

BATCH = 16


class LocalTrunk:
    """Stands in for the data plane: the trunk's stages and the loss, in-process."""

    def __init__(self, model: SplittableModel, cut: int) -> None:
        self.trunk = nn.Sequential(*copy.deepcopy(model).stages[cut:])

    def forward(self, activations: Tensor, labels: Tensor, *,
                example_ids: Tensor | None = None) -> tuple[Tensor, float, int]:
        received = activations.detach().requires_grad_()
        loss = nn.functional.cross_entropy(self.trunk(received), labels)
        loss.backward()
        assert received.grad is not None
        return received.grad, float(loss.detach()), 0


def bn_dropout_model(seed: int = 0) -> SplittableModel:
    """Three stages with BatchNorm and dropout on the device's side (digits-sized input)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        stages = [
            nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Dropout(0.3)),
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.MaxPool2d(2)),
            nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 10)),
        ]
    return SplittableModel(stages, input_shape=(1, 8, 8), num_classes=10)


def make_step(kind: str, model: SplittableModel, cut: int, *, recompute: bool) -> ClientStep:
    if kind == "local_loss":
        spec = RunSpec(strategy=LocalLossOptions(lr=0.1, momentum=0.9, bulk=True))
        return LocalLossStep(model, spec, cut=cut, recompute=recompute)
    step_class = {"split": SplitStep, "whole": WholeModelStep}[kind]
    return step_class(model, plain_spec(0.1, momentum=0.9), cut=cut, recompute=recompute)


def train(step: ClientStep, batches: list[tuple[Tensor, Tensor]], *, seed: int = 0) -> None:
    """Train ``step`` on ``batches`` as the loop does (SGD from the spec, train mode)."""
    options = step.spec.strategy
    optimizer = torch.optim.SGD(step.trained().parameters(), lr=options.lr,
                                momentum=options.momentum)
    channel = LocalTrunk(step.model, step.cut) if step.needs_channel else None
    step.trained().train()
    torch.manual_seed(seed)  # the same dropout masks for every run
    for inputs, labels in batches:
        step.train_batch(inputs, labels, channel, optimizer)  # type: ignore[arg-type]


# ---------------------------------------------------------------- recomputed == plain


@pytest.mark.parametrize(("kind", "network", "cut"), [
    ("split", "bn_dropout", 2), ("local_loss", "bn_dropout", 2), ("whole", "bn_dropout", 2),
    # Cuts after a ReLU: the split step masks it and frees the output it sent.
    ("split", "resnet", 1), ("split", "resnet", 2),
])
def test_recomputed_step_equals_the_plain_step(kind: str, network: str, cut: int) -> None:
    # One batch more than are measured: the meter's hooks and plain autograd both covered.
    batches = fixed_batches(ClientStep.measured_batches + 1, batch=BATCH)
    model = bn_dropout_model() if network == "bn_dropout" else digits_like_model(network)
    plain = make_step(kind, copy.deepcopy(model), cut, recompute=False)
    recomputed = make_step(kind, copy.deepcopy(model), cut, recompute=True)
    train(plain, batches)
    train(recomputed, batches)
    expected, got = plain.trained().state_dict(), recomputed.trained().state_dict()
    assert expected.keys() == got.keys()
    for key in expected:  # weights, BN running statistics, num_batches_tracked
        torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-7, msg=key)
    grads = zip(plain.trained().parameters(), recomputed.trained().parameters(), strict=True)
    for p, q in grads:
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7)


def test_recomputation_does_not_update_batchnorm_twice() -> None:
    model, batches = bn_dropout_model(), fixed_batches(3, batch=BATCH)
    step = make_step("split", model, 2, recompute=True)
    train(step, batches)
    tracked = [m.num_batches_tracked for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert [int(t) for t in tracked] == [len(batches)] * 2


def test_every_step_takes_the_recompute_option_and_estimates_with_it() -> None:
    model, batch = digits_like_model("resnet"), 32
    split = SplitStep(model, plain_spec(0.1), cut=3, recompute=True)
    assert split.memory_bytes(batch) == client_train_memory_bytes(
        model, 3, batch_size=batch, recompute=True, frees_output=True)
    assert split.memory_bytes(batch) < SplitStep(model, plain_spec(0.1), cut=3).memory_bytes(batch)
    ushaped_spec = RunSpec(strategy=UShapedOptions(lr=0.1, momentum=0.0, tail_cut=4))
    local_spec = RunSpec(strategy=LocalLossOptions(lr=0.1, bulk=True))
    for make in (lambda rc: UShapedStep(model, ushaped_spec, cut=3, recompute=rc),
                 lambda rc: LocalLossStep(model, local_spec, cut=3, recompute=rc),
                 lambda rc: WholeModelStep(model, plain_spec(0.1), cut=3, recompute=rc)):
        assert make(True).recompute and not make(False).recompute
        assert make(True).memory_bytes(batch) < make(False).memory_bytes(batch)


# ---------------------------------------------------------------- measured vs estimated


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("cut", [1, 2, 4])
def test_measured_peak_is_within_the_estimate(cut: int, recompute: bool) -> None:
    model = digits_like_model("resnet")
    step = make_step("split", model, cut, recompute=recompute)
    train(step, fixed_batches(2, batch=BATCH))
    estimate = step.memory_bytes(BATCH)
    assert 0 < step.peak_memory_bytes <= estimate
    # The estimate is per stage what autograd saves, so it is tight: the rest is
    # BatchNorm's batch statistics counted for every stage although a
    # recomputing backward rebuilds one stage at a time.
    assert estimate <= 1.01 * step.peak_memory_bytes


def test_measured_whole_model_peak_is_within_the_estimate() -> None:
    model = digits_like_model("resnet")
    step = make_step("whole", model, 1, recompute=False)
    train(step, fixed_batches(2, batch=BATCH))
    assert step.peak_memory_bytes <= step.memory_bytes(BATCH) <= 1.01 * step.peak_memory_bytes


def test_recomputation_lowers_the_measured_peak_of_a_deep_bottom() -> None:
    peaks = {}
    for recompute in (False, True):
        step = make_step("split", digits_like_model("resnet"), 4, recompute=recompute)
        train(step, fixed_batches(2, batch=BATCH))
        peaks[recompute] = step.peak_memory_bytes
    assert peaks[True] < 0.9 * peaks[False]


def test_a_freed_output_and_a_masked_relu_lower_the_peak_at_a_relu_cut() -> None:
    """At cut 1 (conv, BatchNorm, ReLU) the plain step holds the input, the BatchNorm's
    input and the output; recomputed, at most the input and one of the other two
    (and a one-byte mask): about the output's bytes less."""
    model = digits_like_model("resnet")
    peaks = {}
    for recompute in (False, True):
        step = make_step("split", copy.deepcopy(model), 1, recompute=recompute)
        train(step, fixed_batches(2, batch=BATCH))
        peaks[recompute] = step.peak_memory_bytes
    output_bytes = BATCH * model.stage_costs()[0].activation_bytes_per_sample
    assert peaks[True] <= peaks[False] - 0.7 * output_bytes
    masked = [m for m in model.modules() if isinstance(m, MaskReLU)]
    assert not masked  # the steps trained copies


def test_mask_relu_is_relu_with_a_one_byte_mask_saved() -> None:
    x = torch.randn(4, 8, 5, 5)
    x[0, 0] = 0.0  # ReLU's gradient at exactly 0 is 0, as threshold_backward has it
    grad = torch.randn_like(x)
    results = []
    for relu in (nn.ReLU(), MaskReLU()):
        leaf = x.clone().requires_grad_()
        saved: list[Tensor] = []

        def keep(t: Tensor, saved: list[Tensor] = saved) -> Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = relu(leaf)
        out.backward(grad)
        results.append((out.detach(), leaf.grad, saved))
    (out_a, grad_a, saved_a), (out_b, grad_b, saved_b) = results
    assert torch.equal(out_a, out_b) and torch.equal(grad_a, grad_b)
    assert [t.dtype for t in saved_a] == [torch.float32]
    assert [t.dtype for t in saved_b] == [torch.bool]
    assert saved_b[0].shape == x.shape
    with torch.no_grad():  # nothing saved, the same function
        assert torch.equal(MaskReLU()(x), torch.relu(x))


def test_mask_cut_relu_replaces_only_the_relu_that_makes_the_stage_output() -> None:
    model = digits_like_model("resnet")
    keys = model.state_dict().keys()
    assert mask_cut_relu(model, 1)  # the stem: Sequential(conv, BatchNorm, ReLU)
    assert isinstance(model.stages[0][-1], MaskReLU)
    assert mask_cut_relu(model, 2)  # a group of blocks: the last block's relu2
    block = model.stages[1][-1]
    assert isinstance(block.relu2, MaskReLU) and not isinstance(block.relu1, MaskReLU)
    assert not mask_cut_relu(model, 2)  # already masked
    assert model.state_dict().keys() == keys
    assert sum(isinstance(m, MaskReLU) for m in model.modules()) == 2
    assert not mask_cut_relu(bn_dropout_model(), 2)  # ends in max pooling
    with pytest.raises(ValueError, match="cut"):
        mask_cut_relu(model, 0)


def test_meter_counts_a_storage_once_and_only_while_it_lives() -> None:
    layer = nn.Linear(4, 4)
    meter = MemoryMeter(layer)
    with meter:
        a = torch.zeros(256)  # 1 KiB
        meter.watch(a)
        meter.watch(a[:10])  # a view: the same storage
        assert meter.live_bytes == 1024
        meter.watch(layer.weight)  # a parameter is counted as state, not as activation
        del a
        assert meter.live_bytes == 0
        b = torch.zeros(128)
        meter.watch(b)
    assert meter.peak_saved_bytes == 1024
    assert meter.peak_bytes == 1024 + 4 * (16 + 4)  # the layer's weights, no grads yet
    meter.watch(b)  # outside the window: ignored
    assert meter.live_bytes == 0


def test_meter_sees_the_tensors_a_layer_saves() -> None:
    layer = nn.Linear(64, 64)
    x = torch.randn(32, 64)
    meter = MemoryMeter(layer)
    with meter:
        hidden = torch.relu(layer(x))  # Linear saves x; ReLU saves its output
        assert meter.live_bytes == 2 * 32 * 64 * 4
        hidden.sum().backward()
        del hidden  # x is still ours
        assert meter.live_bytes == 32 * 64 * 4
    assert meter.peak_saved_bytes == 2 * 32 * 64 * 4
    assert meter.live_bytes == 0  # outside the window


def test_only_the_first_batches_of_a_round_are_measured() -> None:
    step = make_step("split", digits_like_model("resnet"), 2, recompute=False)
    measured: list[MemoryMeter] = []
    original = MemoryMeter.__enter__

    def spy(meter: MemoryMeter) -> MemoryMeter:
        measured.append(meter)
        return original(meter)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MemoryMeter, "__enter__", spy)
        train(step, fixed_batches(step.measured_batches + 2, batch=4))
    assert len(measured) == step.measured_batches
    assert step.peak_memory_bytes == max(m.peak_bytes for m in measured)


# ---------------------------------------------------------------- the cost table


def test_cut_costs_follow_the_stage_costs() -> None:
    model = digits_like_model("resnet")
    costs = model.stage_costs()
    table = cut_costs(model, batch_size=BATCH, leak={2: 0.5})
    assert [row.cut for row in table] == model.valid_cuts
    for cut in (1, 3):
        row = table[cut - 1]
        client, server = costs[:cut], costs[cut:]
        forward = sum(c.flops_per_sample for c in client)
        assert row.client_flops_per_sample == TRAIN_TO_FORWARD_FLOPS * forward
        # Recomputation rebuilds every stage but the last (which runs plain).
        assert row.recompute_flops_per_sample == sum(c.flops_per_sample for c in client[:-1])
        assert row.server_flops_per_sample == 3 * sum(c.flops_per_sample for c in server)
        assert row.smashed_bytes_per_sample == costs[cut - 1].activation_bytes_per_sample
        assert row.client_param_bytes == 4 * sum(c.params for c in client)
        assert row.memory_bytes == client_train_memory_bytes(model, cut, batch_size=BATCH)
        assert row.recompute_memory_bytes == client_train_memory_bytes(
            model, cut, batch_size=BATCH, recompute=True)
        assert row.leak is None
    assert table[1].leak == 0.5


def test_a_step_that_frees_its_output_has_the_last_stage_rebuilt_in_the_table() -> None:
    model = digits_like_model("resnet")
    costs = model.stage_costs()
    table = cut_costs(model, batch_size=BATCH, frees_output=True)
    for row in table:
        client = costs[:row.cut]
        assert row.recompute_flops_per_sample == sum(c.flops_per_sample for c in client)
        assert row.recompute_memory_bytes == SplitStep(
            copy.deepcopy(model), plain_spec(0.1), cut=row.cut, recompute=True
        ).memory_bytes(BATCH)
        assert row.memory_bytes == client_train_memory_bytes(model, row.cut, batch_size=BATCH)


def test_a_ushaped_cost_table_puts_the_tail_on_the_device() -> None:
    """Per-client cuts for U-shaped learning: the tail's work, weights, memory and features
    are the device's at every cut; the trunk does only the stages between."""
    model = digits_like_model("resnet")
    costs = model.stage_costs()
    tail_cut = 4
    plain = {row.cut: row for row in cut_costs(model, batch_size=BATCH)}
    table = cut_costs(model, batch_size=BATCH, tail_cut=tail_cut, frees_output=True)
    assert [row.cut for row in table] == [1, 2, 3]  # the trunk keeps at least one stage
    tail = costs[tail_cut:]
    for row in table:
        split_row = plain[row.cut]
        tail_flops = 3 * sum(c.flops_per_sample for c in tail)
        assert row.client_flops_per_sample == split_row.client_flops_per_sample + tail_flops
        assert row.recompute_flops_per_sample == sum(
            c.flops_per_sample for c in costs[:row.cut])  # the head only, all of it
        assert row.server_flops_per_sample == 3 * sum(
            c.flops_per_sample for c in costs[row.cut:tail_cut])
        assert row.smashed_bytes_per_sample == (split_row.smashed_bytes_per_sample
                                                + costs[tail_cut - 1].activation_bytes_per_sample)
        assert row.client_param_bytes == 4 * sum(
            c.params for c in [*costs[:row.cut], *tail])
        spec = RunSpec(strategy=UShapedOptions(tail_cut=tail_cut))
        assert row.memory_bytes == UShapedStep(model, spec, cut=row.cut).memory_bytes(BATCH)
        assert row.recompute_memory_bytes == UShapedStep(
            copy.deepcopy(model), spec, cut=row.cut, recompute=True).memory_bytes(BATCH)
        assert (row.exchanges_per_batch, split_row.exchanges_per_batch) == (2, 1)


def test_the_plain_estimate_counts_shared_boundaries_once() -> None:
    model = digits_like_model("resnet")
    costs = model.stage_costs()[:3]
    estimate = client_train_memory_bytes(model, 3, batch_size=BATCH)
    params_state = 3 * 4 * sum(c.params for c in costs)
    # BatchNorm saves its batch mean and inverse std per channel, not per sample.
    channels = sum(m.num_features for m in nn.Sequential(*model.stages[:3]).modules()
                   if isinstance(m, nn.BatchNorm2d))
    batch_norm_stats = 2 * 4 * channels
    assert channels > 0
    assert estimate == (segment_memory_bytes_per_sample(costs) * BATCH + params_state
                        + batch_norm_stats)
    with pytest.raises(ValueError, match="1..5"):
        client_train_memory_bytes(model, 6, batch_size=BATCH)


def test_memory_saving_ratio_measures_both_sides() -> None:
    report = memory_saving_ratio(digits_like_model("resnet"), 1, batch_size=8)
    assert report["cut"] == 1
    assert report["ratio"] == report["whole_bytes"] / report["client_bytes"] > 1
    assert report["plain_ratio"] == report["whole_bytes"] / report["client_plain_bytes"] > 1
