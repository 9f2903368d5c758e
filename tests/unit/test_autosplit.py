"""torch.fx auto-splitting: cut points, exactness, shared state, clear errors."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import Tensor, nn

from splitlearn.models import SplittableModel, build_model
from splitlearn.models.autosplit import AutoSplitError, AutoSplitModel, auto_split, find_cut_points
from splitlearn.stages import bottom_state, split


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv2(torch.relu(self.bn(self.conv1(x))))
        return torch.relu(out + x)  # the skip connection


class UserNet(nn.Module):
    """A user's model, written with no thought of splitting: functional calls,
    skip connections, a flatten method call."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block1 = Residual(8)
        self.block2 = Residual(8)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(32, 5)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.stem(x))
        x = self.block2(self.block1(x))
        return self.fc(self.pool(x).flatten(1))


def _x(n: int = 4, size: int = 8, seed: int = 0) -> Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _split_step(bottom: nn.Module, trunk: nn.Module, x: Tensor) -> Tensor:
    act = bottom(x)
    received = act.detach().requires_grad_()
    out = trunk(received)
    out.square().sum().backward()
    act.backward(received.grad)
    return out


def test_cut_points_skip_residual_interiors() -> None:
    torch.manual_seed(0)
    points = find_cut_points(UserNet(), _x())
    names = [p.node for p in points]
    # Between blocks (after the stem's relu, after each block's residual add
    # and its final relu) and in the head.
    assert names == ["stem", "relu", "add", "relu_2", "add_1", "relu_4", "pool", "flatten"]
    ops = [p.op for p in points]
    assert ops == ["stem", "relu", "add", "relu", "add", "relu", "pool", ".flatten"]
    # Nothing inside a block: its input is still needed by the skip connection.
    assert not any(n.startswith(("block1_", "block2_")) for n in names)
    assert "relu_1" not in names and "relu_3" not in names
    assert points[1].shape == (8, 8, 8)
    assert points[1].activation_bytes_per_sample == 4 * 8 * 8 * 8
    assert points[-1].shape == (32,)


@pytest.mark.parametrize("train", [True, False])
def test_auto_split_user_model_equals_whole(train: bool) -> None:
    torch.manual_seed(0)
    net = UserNet().train(train)
    x = _x()
    reference = copy.deepcopy(net)
    model = auto_split(net, x)
    assert isinstance(model, SplittableModel) and isinstance(model, AutoSplitModel)
    assert model.num_stages == 9 and model.input_shape == (3, 8, 8) and model.num_classes == 5
    assert model.stage_names[:2] == ("stem", "relu")
    # The probe run left BN statistics alone.
    assert torch.equal(net.block1.bn.running_mean, reference.block1.bn.running_mean)
    expected = reference(x)
    expected.square().sum().backward()
    for cut in model.valid_cuts:
        halves = copy.deepcopy(model)
        got = _split_step(*split(halves, cut), x)
        assert (got - expected).abs().max().item() <= 1e-6, cut
        grads = {n: p.grad for n, p in reference.named_parameters()}
        for key, p in halves.named_parameters():
            # Stage keys are "stages.<i>.<original path>".
            original = key.split(".", 2)[2]
            assert (p.grad - grads[original]).abs().max().item() <= 1e-6, (cut, key)


def test_auto_split_shares_parameters_and_bn_state() -> None:
    torch.manual_seed(0)
    net = UserNet().train()
    model = auto_split(net, _x(), cuts=["relu_2"])
    assert model.num_stages == 2 and model.cut_points[0].node == "relu_2"
    assert model.stages[0].block1.conv1.weight is net.block1.conv1.weight
    before = net.block1.bn.running_mean.clone()
    _split_step(*split(model, 1), _x(seed=1))
    # BN running statistics are the original module's, and travel with the bottom.
    assert not torch.equal(net.block1.bn.running_mean, before)
    state = bottom_state(model, 1)
    assert torch.equal(state["0.block1.bn.running_mean"], net.block1.bn.running_mean)
    assert not any(key.startswith("0.block2") for key in state)
    assert net.block1.conv1.weight.grad is not None


def test_auto_split_costs_work_unchanged() -> None:
    torch.manual_seed(0)
    model = auto_split(UserNet(), _x(), cuts=["relu", "relu_4"])
    costs = model.stage_costs()
    assert [c.name for c in costs] == ["relu", "relu_4", "output"]
    assert sum(c.params for c in costs) == sum(p.numel() for p in UserNet().parameters())
    # Stage 0: conv3x3 3->8 on 8x8 with bias; the functional relu counts 0.
    assert costs[0].flops_per_sample == 2 * 3 * 9 * 512 + 512
    assert model.cut_shape(1) == (8, 8, 8)


def test_unknown_cut_lists_the_valid_ones() -> None:
    with pytest.raises(AutoSplitError, match=r"\['nope'\].*'stem', 'relu', 'add'"):
        auto_split(UserNet(), _x(), cuts=["nope"])


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:  # data-dependent control flow
            return self.fc(x)
        return -x


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.branchy = Branchy()
        self.post = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.post(self.branchy(torch.relu(self.pre(x))))


def test_untraceable_model_names_the_operation() -> None:
    with pytest.raises(AutoSplitError) as info:
        auto_split(Wrapper(), torch.randn(2, 4))
    message = str(info.value)
    assert "cannot trace Wrapper" in message
    assert "gt = operator.gt(sum_1, 0)" in message  # the value that decided the branch
    assert "if x.sum() > 0:" in message and "test_autosplit.py" in message
    assert "branchy (Branchy)" in message  # the module being traced
    assert "leaf_modules" in message


def test_leaf_modules_keep_untraceable_parts_whole() -> None:
    torch.manual_seed(0)
    net = Wrapper()
    x = torch.randn(2, 4)
    model = auto_split(net, x, leaf_modules=[Branchy])
    assert [p.node for p in model.cut_points] == ["pre", "relu", "branchy"]
    torch.testing.assert_close(model(x), net(x), rtol=0, atol=0)


def test_other_trace_failures_are_wrapped() -> None:
    class Numpyish(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x * float(x.mean())

    with pytest.raises(AutoSplitError, match=r"cannot trace Numpyish.*float\(x.mean\(\)\)"):
        auto_split(Numpyish(), torch.randn(2, 4))


def test_tied_weights_are_never_split_apart() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.mid = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc(torch.relu(self.mid(torch.relu(self.fc(x)))))

    names = [p.node for p in find_cut_points(Tied(), torch.randn(2, 4))]
    assert names == []  # every cut would put self.fc on both sides
    with pytest.raises(AutoSplitError, match="no point"):
        auto_split(Tied(), torch.randn(2, 4))


def test_in_place_consumers_block_the_cut() -> None:
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.act = nn.ReLU(inplace=True)
            self.b = nn.Linear(4, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.b(self.act(self.a(x)))

    # After "a" the next stage would modify its (leaf) input in place.
    assert [p.node for p in find_cut_points(InPlace(), torch.randn(2, 4))] == ["act"]


def test_needs_one_input_and_one_tensor_output() -> None:
    class TwoIn(nn.Module):
        def forward(self, x: Tensor, y: Tensor) -> Tensor:
            return x + y

    class TupleOut(nn.Module):
        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            return x + 1, x - 1

    with pytest.raises(AutoSplitError, match="exactly one input"):
        find_cut_points(TwoIn(), torch.randn(2, 4))
    with pytest.raises(AutoSplitError, match="returning one tensor"):
        find_cut_points(TupleOut(), torch.randn(2, 4))


@pytest.mark.parametrize("name,size", [("cnn", 8), ("resnet18", 16), ("vit", 8),
                                       ("densenet121", 8)])
def test_auto_split_zoo_models_equal_their_output(name: str, size: int) -> None:
    model = build_model(name, in_channels=3, image_size=size, num_classes=10, seed=0).eval()
    x = _x(2, size)
    auto = auto_split(model, x)
    with torch.no_grad():
        assert torch.equal(auto(x), model(x))
    # Every hand-made stage boundary is among the cut points found automatically:
    # some auto cut has the same parameters before it and the same crossing shape.
    auto_cuts = {
        (frozenset(id(p) for p in nn.ModuleList(auto.stages[:k]).parameters()),
         auto.cut_points[k - 1].shape)
        for k in auto.valid_cuts
    }
    for k in model.valid_cuts:
        before = frozenset(id(p) for p in nn.ModuleList(model.stages[:k]).parameters())
        assert (before, model.cut_shape(k)) in auto_cuts, k
    # Costs agree: auto stages regroup the same leaf modules (attention included).
    flops = sum(c.flops_per_sample for c in auto.stage_costs())
    assert flops == sum(c.flops_per_sample for c in model.stage_costs())


def test_traces_in_threads_take_turns_and_leave_torch_unpatched(tiny_switch_interval) -> None:
    """fx patches ``nn.Module.__call__`` process-wide while it traces; two traces at once
    failed each other and could leave the patch in place for good."""
    original = nn.Module.__call__
    errors: list[BaseException] = []

    def split_some() -> None:
        for _ in range(5):
            try:
                model = auto_split(UserNet(), torch.zeros(2, 3, 8, 8))
                assert model.num_stages > 1
            except BaseException as err:  # noqa: BLE001 - collected for the assert below
                errors.append(err)

    threads = [threading.Thread(target=split_some) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert nn.Module.__call__ is original
