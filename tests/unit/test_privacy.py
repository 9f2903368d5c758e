"""Privacy: clipping, noise on the wire of every protocol, accounting, DP-SGD, budgets."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from opacus.accountants import RDPAccountant
from opacus.data_loader import DPDataLoader
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from clients.loop import train_round
from clients.steps.base import ClientStep
from clients.steps.local_loss import LocalLossStep
from clients.steps.split import SplitStep
from clients.steps.ushaped import UShapedStep
from protocols import check_config, protocol_named
from protocols.local_loss import LocalLossOptions
from protocols.splitfed import SplitFedV2Options
from protocols.ushaped import UShapedOptions
from server.trunk import Trunk
from splitlearn.config import (
    DataPlaneConfig,
    OptimizerConfig,
    PrivacyConfig,
    RunSpec,
    StrategyConfig,
    to_object,
)
from splitlearn.dataplane import (
    InProcessTransport,
    TokenRegistry,
    TrunkChannel,
    TrunkEndpoint,
)
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import decode_tensor
from splitlearn.light_sgd import LightSGD
from splitlearn.messages import SMASHED_RECORD_KEY
from splitlearn.models import build_model
from splitlearn.privacy import (
    ClientPrivacy,
    DPSGDBottom,
    GaussianActivationMechanism,
    PrivacyAccountant,
    PrivacyBudgetExhausted,
    clip_per_sample,
    compute_epsilon,
    make_client_privacy,
    per_sample_norms,
    with_release_at_cut,
)
from splitlearn.privacy.mechanism import batch_coupled_modules
from splitlearn.privacy.registry import (
    ActivationGaussianPrivacy,
    DPSGDClientPrivacy,
    ReleaseAtCut,
    UnprotectableRelease,
)
from splitlearn.stages import split
from tests.conftest import digits_like_model, fixed_batches, small_config

# --- clipping ---------------------------------------------------------------------------


def test_clipping_bounds_every_sample_and_keeps_small_ones():
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-3, 0.5, 0.99, 1.0, 3.0, 1e4]).reshape(-1, 1, 1, 1)
    x = torch.randn(6, 4, 3, 3, generator=g)
    x = x / per_sample_norms(x).reshape(-1, 1, 1, 1) * scales
    clipped = clip_per_sample(x, max_norm=1.0)
    norms = per_sample_norms(clipped)
    assert (norms <= 1.0 + 1e-6).all()
    # Inside the ball: unchanged (up to the 1e-6 guard); outside: scaled onto the sphere.
    torch.testing.assert_close(clipped[:3], x[:3], rtol=1e-5, atol=0)
    torch.testing.assert_close(norms[4:], torch.ones(2), rtol=1e-5, atol=0)
    # Direction is preserved.
    cos = nn.functional.cosine_similarity(clipped.flatten(1), x.flatten(1))
    torch.testing.assert_close(cos, torch.ones(6), rtol=1e-5, atol=1e-6)


def test_clipping_gradient_matches_a_per_sample_reference():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 7, generator=g) * torch.tensor([[0.1], [1.0], [2.0], [5.0], [0.5]]))
    upstream = torch.randn(5, 7, generator=g)
    xb = x.clone().requires_grad_(True)
    clip_per_sample(xb, max_norm=1.0).backward(upstream)
    expected = []
    for i in range(5):  # slow reference: one sample at a time, explicit formula
        xi = x[i].clone().requires_grad_(True)
        norm = xi.norm()
        out = xi * torch.clamp(1.0 / (norm + 1e-6), max=1.0)
        (out * upstream[i]).sum().backward()
        expected.append(xi.grad)
    torch.testing.assert_close(xb.grad, torch.stack(expected))


def test_mechanism_noise_has_std_sigma_c_and_is_reproducible_from_its_generator():
    mech = GaussianActivationMechanism(
        clip_norm=2.0, noise_multiplier=0.5, generator=torch.Generator().manual_seed(3)
    )
    released = mech(torch.zeros(4000, 8, 4, 4))
    assert released.std().item() == pytest.approx(1.0, rel=0.02)  # sigma * C
    assert abs(released.mean().item()) < 0.01
    again = GaussianActivationMechanism(
        clip_norm=2.0, noise_multiplier=0.5, generator=torch.Generator().manual_seed(3)
    )(torch.zeros(4000, 8, 4, 4))
    torch.testing.assert_close(released, again)
    assert mech.noise_std == pytest.approx(1.0)
    assert mech.accounting_noise_multiplier == pytest.approx(0.25)  # sigma / 2: sensitivity 2C


@pytest.mark.parametrize("kwargs", [{"clip_norm": 0.0, "noise_multiplier": 1.0},
                                    {"clip_norm": 1.0, "noise_multiplier": -1.0}])
def test_mechanism_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError, match="must be"):
        GaussianActivationMechanism(**kwargs)


# --- an in-process data plane whose frames can be read back ----------------------------------


class RecordingTransport(InProcessTransport):
    """The in-process transport, keeping every frame it sends."""

    def __init__(self, endpoint: TrunkEndpoint, token: str) -> None:
        super().__init__(endpoint, token)
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)
        super().send(data)

    def activations_sent(self) -> list[Tensor]:
        """The activations of every forward/smashed frame, decoded from the bytes sent."""
        out = []
        for data in self.sent:
            request = pb.Request.FromString(data)
            kind = request.WhichOneof("kind")
            if kind in ("forward", "smashed"):
                part = getattr(request, kind)
                out.append(decode_tensor(part.activations, name="activations", max_bytes=1 << 24))
        return out


class LocalTrunk:
    """A trunk serving ``protocol`` behind an endpoint, reached without a network."""

    def __init__(self, model, protocol: str, options: StrategyConfig, *, lr: float = 0.1) -> None:
        self.protocol = protocol
        self.trunk = Trunk(copy.deepcopy(model), lr=lr)
        dataplane = DataPlaneConfig(max_frame_bytes=1 << 22, max_batch=64)
        factory = protocol_named(protocol).trunk
        assert factory is not None
        self.handler = factory(self.trunk, options, dataplane)
        self.tokens = TokenRegistry()
        self.endpoint = TrunkEndpoint({protocol: self.handler}, self.tokens, dataplane=dataplane)

    def channel(self, cut: int = 1, client: str = "c0") -> tuple[TrunkChannel, RecordingTransport]:
        token = self.tokens.issue(client=client, protocol=self.protocol, cut=cut,
                                  server_round=1, ttl_s=60)
        transport = RecordingTransport(self.endpoint, token)
        return TrunkChannel(transport), transport

    def finish(self, clients=("c0",)) -> None:
        self.handler.finish_round(list(clients))


def loader_of(batches, *, batch_size: int | None = None) -> DataLoader:
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return DataLoader(TensorDataset(x, y), batch_size=batch_size or len(batches[0][1]))


# --- activation privacy on every protocol that sends activations ------------------------------

ACT_CLIP, ACT_SIGMA, ACT_SEED = 1.0, 0.5, 11

PROTOCOL_CASES = {
    "splitfed_v2": ("splitfed_v2", SplitStep, SplitFedV2Options(lr=0.1, momentum=0.0)),
    "ushaped": ("ushaped", UShapedStep, UShapedOptions(lr=0.1, momentum=0.0)),
    "local_loss": ("local_loss", LocalLossStep, LocalLossOptions(lr=0.1, momentum=0.0)),
    "local_loss_bulk": (
        "local_loss", LocalLossStep, LocalLossOptions(lr=0.1, momentum=0.0, bulk=True)
    ),
}


def released_rows(case: str, step: ClientStep, transport: RecordingTransport | None
                  ) -> list[Tensor]:
    """What left the device, per batch: decoded frames, or the bulk reply's arrays."""
    if transport is not None:
        return transport.activations_sent()
    arrays = step.reply_arrays()[SMASHED_RECORD_KEY]
    sizes = [int(n) for n in arrays["batch-sizes"].tolist()]
    return list(arrays["activations"].split(sizes))


@pytest.mark.parametrize("case", list(PROTOCOL_CASES))
def test_activation_privacy_clips_and_noises_what_leaves_every_protocol(case):
    protocol, step_class, options = PROTOCOL_CASES[case]
    model = digits_like_model("cnn")
    batches = fixed_batches(3)
    step = step_class(model, RunSpec(strategy=options), cut=1)
    settings = PrivacyConfig(name="activation_gaussian", clip_norm=ACT_CLIP,
                             noise_multiplier=ACT_SIGMA)
    privacy = make_client_privacy(settings, loader_of(batches),
                                  generator=torch.Generator().manual_seed(ACT_SEED))
    assert isinstance(privacy, ActivationGaussianPrivacy)
    server = channel = transport = None
    if step.needs_channel:
        server = LocalTrunk(model, protocol, options)
        channel, transport = server.channel()
    raw: list[Tensor] = []  # the activations at the cut, before any privacy (device side)
    model.stages[0].register_forward_hook(lambda m, i, out: raw.append(out.detach().clone()))
    report = train_round(step, channel, privacy, epochs=1)
    if server is not None:
        server.finish()
    assert report.steps == 3 and len(raw) == 3

    sent = released_rows(case, step, transport)
    assert len(sent) == 3
    noise_source = torch.Generator().manual_seed(ACT_SEED)  # the client's secret, replayed
    for rows, clean in zip(sent, raw, strict=True):
        assert rows.shape == clean.shape
        assert per_sample_norms(clean).max() > 2 * ACT_CLIP  # the clip binds
        clipped = clip_per_sample(clean, max_norm=ACT_CLIP)
        noise = torch.randn(clean.shape, generator=noise_source) * ACT_SIGMA * ACT_CLIP
        # Exactly the clipped rows plus the generator's noise left the device ...
        torch.testing.assert_close(rows, clipped + noise)
        # ... so without the noise every row lies in the ball of radius C,
        assert (per_sample_norms(rows - noise) <= ACT_CLIP * (1 + 1e-5)).all()
        # and the noise is there, with std sigma * C, not the raw activations.
        assert not torch.allclose(rows, clipped, atol=0.1)
        assert not torch.allclose(rows, clean, atol=0.1)
        assert (rows - clipped).std().item() == pytest.approx(ACT_SIGMA * ACT_CLIP, rel=0.05)
        assert abs((rows - clipped).mean().item()) < 0.05


def test_release_backward_runs_through_the_clip():
    # The update is the SGD step of the network with the clip (and this noise) inserted.
    model = digits_like_model("cnn")
    batches = fixed_batches(1)
    server = LocalTrunk(model, "splitfed_v2", SplitFedV2Options(lr=0.1, momentum=0.0))
    channel, _ = server.channel()
    step = SplitStep(model, RunSpec(strategy=SplitFedV2Options(lr=0.1, momentum=0.0)), cut=1)
    reference = copy.deepcopy(model)
    settings = PrivacyConfig(name="activation_gaussian", clip_norm=0.5, noise_multiplier=0.3)
    privacy = make_client_privacy(settings, loader_of(batches),
                                  generator=torch.Generator().manual_seed(5))
    train_round(step, channel, privacy, epochs=1)

    ref_bottom, ref_trunk = split(reference, 1)
    x, y = batches[0]
    acts = ref_bottom(x)
    noise = torch.randn(acts.shape, generator=torch.Generator().manual_seed(5)) * 0.3 * 0.5
    loss = nn.functional.cross_entropy(ref_trunk(clip_per_sample(acts, max_norm=0.5) + noise), y)
    grads = torch.autograd.grad(loss, list(ref_bottom.parameters()))
    for p, p0, gr in zip(step.bottom.parameters(), ref_bottom.parameters(), grads, strict=True):
        torch.testing.assert_close(p, p0 - 0.1 * gr, rtol=1e-5, atol=1e-6)


def test_fedavg_refuses_activation_privacy(tmp_path):
    cfg = small_config("strategy=fedavg", "privacy=activation_gaussian",
                       "privacy.noise_multiplier=1.0", run_dir=str(tmp_path))
    with pytest.raises(ValueError, match="strategy=fedavg sends none"):
        check_config(cfg)
    # DP-SGD protects the weights fedavg trains: accepted.
    check_config(small_config("strategy=fedavg", "privacy=dpsgd_client",
                              "privacy.noise_multiplier=1.0", run_dir=str(tmp_path)))


@pytest.mark.parametrize("name", ["resnet", "vgg11_bn", "mobilenetv2"])
def test_activation_noise_is_refused_on_a_batchnorm_client_side(name, tmp_path):
    # One example's input moves every row BatchNorm normalises with the batch's statistics.
    model = build_model(name, in_channels=1, image_size=16, num_classes=10, seed=0).train()
    bottom, _ = split(model, 1)
    x = torch.randn(8, 1, 16, 16)
    moved = x.clone()
    moved[0] = torch.randn(1, 16, 16)
    with torch.no_grad():
        others = (bottom(x)[1:] - bottom(moved)[1:]).flatten(1).norm(dim=1)
    assert (others > 1e-3).all()
    assert batch_coupled_modules(bottom)
    with pytest.raises(UnprotectableRelease, match="BatchNorm"):
        ActivationGaussianPrivacy.check_source(bottom)  # what each client checks itself
    cfg = small_config(f"model={name}", "model.cut=1", "dataset.image_size=16",
                       "privacy=activation_gaussian",
                       run_dir=str(tmp_path))
    with pytest.raises(ValueError, match=f"model={name} at cut 1: .*BatchNorm"):
        check_config(cfg)  # and the server's preflight


def test_activation_noise_is_accepted_where_rows_are_independent(tmp_path):
    bottom, _ = split(digits_like_model("cnn"), 1)
    assert batch_coupled_modules(bottom) == []
    ActivationGaussianPrivacy.check_source(bottom)
    check_config(small_config("privacy=activation_gaussian", run_dir=str(tmp_path)))


def test_release_at_cut_is_the_deployed_pipeline():
    model = digits_like_model("cnn")
    x, _ = fixed_batches(1)[0]
    settings = PrivacyConfig(name="activation_gaussian", clip_norm=0.7, noise_multiplier=0.4)
    deployed = with_release_at_cut(model, cut=2, settings=settings,
                                   generator=torch.Generator().manual_seed(9))
    assert isinstance(deployed[2], ReleaseAtCut) and len(deployed) == model.num_stages + 1
    bottom, trunk = split(model, 2)
    with torch.no_grad():
        acts = bottom(x)
        noise = torch.randn(acts.shape, generator=torch.Generator().manual_seed(9)) * 0.4 * 0.7
        expected = trunk(clip_per_sample(acts, max_norm=0.7) + noise)
        torch.testing.assert_close(deployed(x), expected)
    for other in (PrivacyConfig(), PrivacyConfig(name="dpsgd_client", noise_multiplier=1.0)):
        assert with_release_at_cut(model, cut=2, settings=other) is model


def test_none_privacy_changes_nothing_in_the_round():
    data = TensorDataset(torch.rand(40, 1, 8, 8), torch.randint(0, 10, (40,)))
    loader = DataLoader(data, batch_size=16)
    privacy = make_client_privacy(PrivacyConfig(), loader)
    assert type(privacy) is ClientPrivacy and not privacy.protects_activations
    assert privacy.round_steps(epochs=3) == []
    x = torch.randn(4, 3)
    assert privacy.release(x) is x
    assert privacy.batches() is loader
    layer = nn.Linear(2, 2)
    optimizer = privacy.make_optimizer(layer, lr=0.1, momentum=0.5, weight_decay=0.01)
    assert type(optimizer) is LightSGD  # torch's SGD update (test_light_sgd.py)
    assert (optimizer.lr, optimizer.momentum, optimizer.weight_decay) == (0.1, 0.5, 0.01)
    assert optimizer.params == list(layer.parameters())


# --- accounting -------------------------------------------------------------------------------


@pytest.mark.parametrize(("sigma", "q"), [(1.0, 0.01), (0.7, 0.2), (2.0, 1.0)])
def test_epsilon_grows_with_steps_and_equals_opacus(sigma, q):
    ours, opacus = PrivacyAccountant(), RDPAccountant()
    epsilons = []
    for steps in range(1, 31):
        ours.step(noise_multiplier=sigma, sample_rate=q)
        opacus.step(noise_multiplier=sigma, sample_rate=q)
        if steps in (1, 4, 30):  # each epsilon costs ~0.1 s of RDP maths
            epsilons.append(ours.epsilon(1e-5))
            assert epsilons[-1] == opacus.get_epsilon(delta=1e-5)  # bit for bit
    assert all(b > a for a, b in zip(epsilons, epsilons[1:], strict=False))
    assert compute_epsilon(history=[(sigma, q, 30)], delta=1e-5) == epsilons[-1]


def test_a_mixed_history_is_opacus_accountants_sum_bit_for_bit_and_reuses_each_pairs_rdp():
    from splitlearn.privacy.accounting import _one_step_rdp

    history = [(1.0, 0.22, 10), (0.5, 1.0, 3), (1.0, 0.22, 7), (0.01, 1.0, 1)]
    opacus = RDPAccountant()
    for sigma, q, n in history:
        for _ in range(n):
            opacus.step(noise_multiplier=sigma, sample_rate=q)
    ours = PrivacyAccountant(history)
    assert ours.history == history == opacus.history
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Opacus: "optimal order is the smallest"
        assert ours.epsilon(1e-5) == opacus.get_epsilon(delta=1e-5)
    computed = _one_step_rdp.cache_info().misses
    # A device charging its next round adds steps of the same pair: nothing is recomputed.
    assert ours.epsilon_after([(1.0, 0.22, 5)], delta=1e-5) > ours.epsilon(1e-5)
    assert _one_step_rdp.cache_info().misses == computed


def test_accountant_history_survives_plain_lists():
    acc = PrivacyAccountant()
    assert acc.epsilon(1e-5) == 0.0 and acc.history == []
    acc.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=5)
    acc.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=2)  # merged
    acc.step(noise_multiplier=0.3, sample_rate=1.0, num_steps=1)
    lists = acc.to_lists()
    assert lists == {"noise-multiplier": [1.0, 0.3], "sample-rate": [0.1, 1.0], "num-steps": [7, 1]}
    again = PrivacyAccountant.from_lists(lists)
    assert again.history == acc.history and again.num_steps == 8
    epsilon = acc.epsilon(1e-5)
    assert again.epsilon(1e-5) == epsilon
    opacus = RDPAccountant()
    for s, q, n in [(1.0, 0.1, 7), (0.3, 1.0, 1)]:
        for _ in range(n):
            opacus.step(noise_multiplier=s, sample_rate=q)
    assert epsilon == pytest.approx(opacus.get_epsilon(delta=1e-5), rel=1e-12)
    with pytest.raises(ValueError, match="lacks"):
        PrivacyAccountant.from_lists({"noise-multiplier": [1.0], "sample-rate": [0.1]})
    with pytest.raises(ValueError, match="differ in length"):
        PrivacyAccountant.from_lists({**lists, "num-steps": [7]})


def test_spend_refuses_past_the_budget_and_changes_nothing():
    acc = PrivacyAccountant()
    round_cost = [(0.5, 1.0, 1)]
    first = acc.spend(round_cost, delta=1e-5, epsilon_max=60.0)
    second = acc.spend(round_cost, delta=1e-5, epsilon_max=60.0)
    assert 0 < first < second <= 60.0
    assert first == pytest.approx(compute_epsilon(history=[(0.5, 1.0, 1)], delta=1e-5))
    with pytest.raises(PrivacyBudgetExhausted) as info:
        for _ in range(100):
            acc.spend(round_cost, delta=1e-5, epsilon_max=60.0)
    history = acc.history
    assert info.value.epsilon_spent <= 60.0 < info.value.epsilon_next
    assert acc.epsilon(1e-5) == pytest.approx(info.value.epsilon_spent)
    assert acc.num_steps < 100
    # Refusing again records nothing either.
    with pytest.raises(PrivacyBudgetExhausted):
        acc.spend(round_cost, delta=1e-5, epsilon_max=60.0)
    assert acc.history == history
    # Without a budget everything is recorded.
    assert acc.spend(round_cost, delta=1e-5, epsilon_max=None) > 60.0


def test_round_costs_per_option():
    data = TensorDataset(torch.rand(100, 1, 8, 8), torch.randint(0, 10, (100,)))
    loader = DataLoader(data, batch_size=32, shuffle=True)  # 4 batches per epoch
    act = make_client_privacy(
        PrivacyConfig(name="activation_gaussian", clip_norm=1.0, noise_multiplier=2.0), loader
    )
    # Every example is released once per epoch: one unamplified Gaussian step each.
    assert act.round_steps(epochs=3) == [(1.0, 1.0, 3)]
    dp = make_client_privacy(
        PrivacyConfig(name="dpsgd_client", clip_norm=1.0, noise_multiplier=1.1), loader
    )
    assert isinstance(dp, DPSGDClientPrivacy)
    assert dp.round_steps(epochs=3) == [(1.1, 0.25, 12)]
    assert dp.expected_batch_size == pytest.approx(25.0)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"name": "laplace"}, "accepted"),
    ({"name": "activation_gaussian", "noise_multiplier": 0.0}, "noise_multiplier"),
    ({"name": "dpsgd_client", "noise_multiplier": 1.0, "clip_norm": 0.0}, "clip_norm"),
    ({"name": "dpsgd_client", "noise_multiplier": 1.0, "delta": 1.0}, "delta"),
    ({"name": "activation_gaussian", "noise_multiplier": 1.0, "epsilon_max": 0.0}, "epsilon_max"),
])
def test_settings_reject_unknown_names_and_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrivacyConfig(**kwargs)


def test_composed_settings_are_validated_when_converted():
    cfg = small_config("privacy=activation_gaussian", "privacy.noise_multiplier=0")
    with pytest.raises(ValueError, match="noise_multiplier"):
        to_object(cfg.privacy)
    good = to_object(small_config("privacy=dpsgd_client", "privacy.noise_multiplier=1.5").privacy)
    assert isinstance(good, PrivacyConfig) and good.noise_multiplier == 1.5 and good.accounted
    assert not PrivacyConfig().accounted


# --- DP-SGD with the trunk's gradient ---------------------------------------------------------


def external_gradient(bottom, head, x, y):
    """What the trunk returns: d(mean cross-entropy)/d(activations)."""
    acts = bottom(x).detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(nn.functional.cross_entropy(head(acts), y), acts)
    return grad


def micro_batch_reference(bottom, x, grad, *, clip, expected_batch_size):
    """Slow reference: one backward per sample, clip its whole gradient, sum, scale."""
    total = [torch.zeros_like(p) for p in bottom.parameters()]
    for i in range(len(x)):
        bottom.zero_grad()
        # Sample i's own loss is B times its share of the mean.
        bottom(x[i:i + 1]).backward(grad[i:i + 1] * len(x))
        per_sample = [p.grad.clone() for p in bottom.parameters()]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in per_sample))
        factor = min(1.0, clip / (float(norm) + 1e-6))
        total = [t + factor * g for t, g in zip(total, per_sample, strict=True)]
    return [t / expected_batch_size for t in total]


@pytest.mark.parametrize("clip", [0.05, 1e6])
def test_dpsgd_clips_per_sample_gradients_driven_by_the_trunk(clip):
    model = digits_like_model("cnn")
    bottom, trunk = split(copy.deepcopy(model), 2)
    reference_bottom = copy.deepcopy(bottom)
    x, y = fixed_batches(1, batch=12)[0]
    grad = external_gradient(bottom, trunk, x, y)
    expected_batch_size = 10.0  # Poisson: the expected, not the actual, batch size
    dp = DPSGDBottom(bottom, lr=1.0, noise_multiplier=0.0, max_grad_norm=clip,
                     expected_batch_size=expected_batch_size)
    before = [p.detach().clone() for p in bottom.parameters()]
    dp.optimizer.zero_grad(set_to_none=True)
    bottom(x).backward(grad)
    dp.optimizer.step()
    dp.close()
    expected = micro_batch_reference(
        reference_bottom, x, grad, clip=clip, expected_batch_size=expected_batch_size
    )
    for p, p0, step in zip(bottom.parameters(), before, expected, strict=True):
        torch.testing.assert_close(p0 - p, step, rtol=1e-4, atol=1e-7)
    if clip > 1e5:  # no clipping, B == expected: plain SGD on the mean loss, scaled B/E
        plain = copy.deepcopy(reference_bottom)
        plain.zero_grad()
        plain(x).backward(grad)
        for p, p0, q in zip(bottom.parameters(), before, plain.parameters(), strict=True):
            torch.testing.assert_close(p0 - p, q.grad * len(x) / expected_batch_size,
                                       rtol=1e-4, atol=1e-7)
    else:  # the summed clipped gradients: at most B * C, over E
        moved = torch.sqrt(sum((p0 - p).pow(2).sum() for p, p0 in zip(
            bottom.parameters(), before, strict=True)))
        assert moved <= len(x) * clip / expected_batch_size * (1 + 1e-5)
    assert not any(hasattr(p, "grad_sample") for p in bottom.parameters())


def test_dpsgd_steps_the_configured_optimiser_on_the_clipped_noised_mean():
    # Noise 0, clip far above every gradient, batch = expected: Opacus's mean gradient is the
    # plain one, so its Adam step must be Adam's step on the plain gradient.
    model = digits_like_model("cnn")
    bottom, trunk = split(copy.deepcopy(model), 2)
    reference = copy.deepcopy(bottom)
    x, y = fixed_batches(1, batch=12)[0]
    grad = external_gradient(bottom, trunk, x, y)
    dp = DPSGDBottom(bottom, lr=0.01, weight_decay=0.1, noise_multiplier=0.0, max_grad_norm=1e6,
                     expected_batch_size=12.0,
                     optimizer=OptimizerConfig(_target_="torch.optim.Adam"))
    assert type(dp.optimizer.original_optimizer) is torch.optim.Adam
    dp.optimizer.zero_grad(set_to_none=True)
    bottom(x).backward(grad)
    dp.optimizer.step()
    dp.close()
    adam = torch.optim.Adam(reference.parameters(), lr=0.01, weight_decay=0.1)
    reference(x).backward(grad)
    adam.step()
    for p, q in zip(bottom.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_dpsgd_empty_batch_takes_a_noise_only_step():
    bottom = nn.Sequential(nn.Flatten(), nn.Linear(64, 200))
    dp = DPSGDBottom(bottom, lr=1.0, noise_multiplier=2.0, max_grad_norm=0.5,
                     expected_batch_size=4.0, generator=torch.Generator().manual_seed(0))
    before = [p.detach().clone() for p in bottom.parameters()]
    dp.optimizer.zero_grad(set_to_none=True)
    dp.optimizer.step()  # no forward, no backward: an empty Poisson batch
    moved = (before[0] - bottom[1].weight).flatten()
    assert moved.std().item() == pytest.approx(2.0 * 0.5 / 4.0, rel=0.05)
    # Exactly the generator's noise, sigma * C, over the expected batch size.
    replay = torch.Generator().manual_seed(0)
    for p, p0 in zip(bottom.parameters(), before, strict=True):
        noise = torch.normal(0.0, 2.0 * 0.5, size=p.shape, generator=replay)
        torch.testing.assert_close(p0 - p, noise / 4.0)


def test_dp_data_loader_samples_at_one_over_the_batches_per_epoch():
    data = TensorDataset(torch.arange(1000).float(), torch.zeros(1000, dtype=torch.long))
    loader = DataLoader(data, batch_size=50, shuffle=True)  # 20 batches per epoch
    settings = PrivacyConfig(name="dpsgd_client", clip_norm=1.0, noise_multiplier=1.0)
    privacy = make_client_privacy(settings, loader, generator=torch.Generator().manual_seed(0))
    batches = privacy.batches()
    assert isinstance(batches, DPDataLoader)
    assert privacy.sample_rate == pytest.approx(1 / 20) == batches.sample_rate
    sizes = []
    for _ in range(10):
        epoch = list(batches)
        assert len(epoch) == len(batches) == 20  # as many batches per epoch as the loader
        for x, _ in epoch:
            assert len(set(x.tolist())) == len(x)  # Poisson: no example twice in a batch
        sizes += [len(x) for x, _ in epoch]
    assert sum(sizes) / len(sizes) == pytest.approx(50, rel=0.05)  # q * n on average
    # The same generator seed draws the same batches.
    again = make_client_privacy(settings, loader, generator=torch.Generator().manual_seed(0))
    first = [x.tolist() for x, _ in again.batches()]
    replay = make_client_privacy(settings, loader, generator=torch.Generator().manual_seed(0))
    assert first == [x.tolist() for x, _ in replay.batches()]


def test_dp_data_loader_yields_empty_batches_with_the_right_shape():
    data = TensorDataset(torch.rand(6, 1, 8, 8), torch.randint(0, 10, (6,)))
    loader = DataLoader(data, batch_size=1)  # q = 1/6: P(empty) = (5/6)^6 ~ 0.33
    settings = PrivacyConfig(name="dpsgd_client", clip_norm=1.0, noise_multiplier=1.0)
    privacy = make_client_privacy(settings, loader, generator=torch.Generator().manual_seed(1))
    empties = [(x, y) for _ in range(5) for x, y in privacy.batches() if len(y) == 0]
    assert empties
    for x, y in empties:
        assert x.shape == (0, 1, 8, 8) and x.dtype == torch.float32
        assert y.shape == (0,) and y.dtype == torch.int64


def test_dpsgd_round_trains_through_the_trunk():
    model = digits_like_model("cnn")
    options = SplitFedV2Options(lr=0.1, momentum=0.0)
    server = LocalTrunk(model, "splitfed_v2", options)
    channel, transport = server.channel()
    step = SplitStep(model, RunSpec(strategy=options), cut=1)
    data = TensorDataset(torch.rand(64, 1, 8, 8), torch.randint(0, 10, (64,)))
    loader = DataLoader(data, batch_size=16)
    privacy = make_client_privacy(
        PrivacyConfig(name="dpsgd_client", clip_norm=1.0, noise_multiplier=1.0), loader,
        generator=torch.Generator().manual_seed(0),
    )
    before = copy.deepcopy(step.bottom.state_dict())
    report = train_round(step, channel, privacy, epochs=2)
    privacy.close()
    assert report.steps == 8  # 4 Poisson batches per epoch, 2 epochs
    assert 0 < report.examples < 2 * 64 * 1.6
    # Activations go out unnoised: every forward is a batch of the bottom's outputs.
    assert sum(len(a) for a in transport.activations_sent()) == report.examples
    assert server.trunk.samples == report.examples
    assert any(not torch.equal(before[k], v) for k, v in step.bottom.state_dict().items())
    assert not any(hasattr(p, "grad_sample") for p in step.bottom.parameters())


# --- DP-SGD on every module the device trains (U-shaped head+tail, local-loss bottom+head) -----


def per_sample_reference(trained: nn.Module, losses, *, clip: float, expected: float):
    """Slow reference: each sample's whole gradient over ``trained``, clipped, summed, over E."""
    params = list(trained.parameters())
    total = [torch.zeros_like(p) for p in params]
    unclipped_norms = []
    for loss in losses:
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads,
                                                                         strict=True)]
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
        unclipped_norms.append(norm)
        factor = min(1.0, clip / (norm + 1e-6))
        total = [t + factor * g for t, g in zip(total, grads, strict=True)]
    return [t / expected for t in total], unclipped_norms


DP_CASES = {
    "ushaped": ("ushaped", UShapedStep, UShapedOptions(lr=1.0, momentum=0.0)),
    "local_loss": ("local_loss", LocalLossStep, LocalLossOptions(lr=1.0, momentum=0.0)),
}


@pytest.mark.parametrize("case", list(DP_CASES))
def test_dpsgd_clips_per_sample_over_every_trained_module(case):
    protocol, step_class, options = DP_CASES[case]
    model = digits_like_model("cnn")
    reference = copy.deepcopy(model)
    step = step_class(model, RunSpec(strategy=options), cut=1)
    ref_step = step_class(reference, RunSpec(strategy=options), cut=1)
    if case == "local_loss":
        ref_step.aux.load_state_dict(step.aux.state_dict())
    x, y = fixed_batches(1, batch=12)[0]
    # One batch of all 12 examples (q = 1: the Poisson sample keeps everyone), tiny noise.
    clip = 0.01
    settings = PrivacyConfig(name="dpsgd_client", clip_norm=clip, noise_multiplier=1e-9)
    privacy = make_client_privacy(settings, DataLoader(TensorDataset(x, y), batch_size=12),
                                  generator=torch.Generator().manual_seed(0))
    assert privacy.sample_rate == 1.0 and privacy.expected_batch_size == 12.0
    server = LocalTrunk(model, protocol, options)
    channel, _ = server.channel()
    before = [p.detach().clone() for p in step.trained().parameters()]
    report = train_round(step, channel, privacy, epochs=1)
    privacy.close()
    server.finish()
    assert report.steps == 1 and report.examples == 12

    if case == "ushaped":  # head, the trunk's stages, tail: the whole model, sample by sample
        losses = [nn.functional.cross_entropy(reference(x[i:i + 1]), y[i:i + 1])
                  for i in range(12)]
    else:  # bottom and auxiliary head
        losses = [nn.functional.cross_entropy(ref_step.aux(ref_step.bottom(x[i:i + 1])),
                                              y[i:i + 1]) for i in range(12)]
    expected, norms = per_sample_reference(ref_step.trained(), losses, clip=clip, expected=12.0)
    assert min(norms) > clip  # every sample is clipped
    moved = [p0 - p.detach() for p, p0 in zip(step.trained().parameters(), before, strict=True)]
    for m, e in zip(moved, expected, strict=True):  # lr = 1
        torch.testing.assert_close(m, e, rtol=1e-3, atol=1e-7)  # C / E ~ 1e-3
    # The summed clipped per-sample gradients are at most B * C long.
    total = math.sqrt(sum(float(m.pow(2).sum()) for m in moved))
    assert total * 12.0 <= 12 * clip * (1 + 1e-4)
    assert not any(hasattr(p, "grad_sample") for p in step.trained().parameters())


@pytest.mark.parametrize("case", list(DP_CASES))
def test_dpsgd_rounds_train_through_the_real_step(case):
    protocol, step_class, options = DP_CASES[case]
    model = digits_like_model("cnn")
    step = step_class(model, RunSpec(strategy=options), cut=1)
    data = TensorDataset(torch.rand(48, 1, 8, 8), torch.randint(0, 10, (48,)))
    privacy = make_client_privacy(
        PrivacyConfig(name="dpsgd_client", clip_norm=1.0, noise_multiplier=1.0),
        DataLoader(data, batch_size=16), generator=torch.Generator().manual_seed(2),
    )
    server = LocalTrunk(model, protocol, options)
    channel, transport = server.channel()
    before = [p.detach().clone() for p in step.trained().parameters()]
    report = train_round(step, channel, privacy, epochs=2)
    privacy.close()
    server.finish()
    assert report.steps == 6 and report.examples > 0  # 3 Poisson batches per epoch
    assert sum(len(a) for a in transport.activations_sent()) == report.examples
    assert server.trunk.samples == report.examples
    assert all(not torch.equal(p, p0) for p, p0 in zip(step.trained().parameters(), before,
                                                        strict=True))
    assert not any(hasattr(p, "grad_sample") for p in step.trained().parameters())


def test_epsilon_against_the_server_ignores_sampling():
    # The server sees which examples each DP-SGD step used, so sampling buys nothing
    # against it: 10 steps at sigma = 1 cost 19.1 at rate 1, not 6.2 at rate 0.22.
    accountant = PrivacyAccountant()
    accountant.step(noise_multiplier=1.0, sample_rate=32 / 144, num_steps=10)
    assert accountant.epsilon(1e-5) == pytest.approx(6.23, abs=0.01)
    assert accountant.epsilon_unamplified(1e-5) == pytest.approx(
        compute_epsilon(history=[(1.0, 1.0, 10)], delta=1e-5))
    assert accountant.epsilon_unamplified(1e-5) == pytest.approx(19.05, abs=0.01)
    # Activation noise is accounted at rate 1 already: the two agree.
    rows = PrivacyAccountant([(0.5, 1.0, 3)])
    assert rows.epsilon_unamplified(1e-5) == pytest.approx(rows.epsilon(1e-5))
    assert PrivacyAccountant().epsilon_unamplified(1e-5) == 0.0
