"""The web device runtime (web/, TensorFlow.js in Chromium) trains stages as PyTorch does.

Each case loads a device's stages (fixed random weights) into the runtime in a headless
Chromium and runs the split step's device side ten times beside PyTorch: the same input
batch and the same random gradient at the cut each step on both sides, SGD with momentum
0.5 and weight decay 1e-4. Every step the activations at the cut and every parameter's
gradient, and at the end the weights and buffers, must equal PyTorch's within
``TOLERANCE``, relative to the reference tensor's largest value (and, for each zoo model's
U-shaped tail, the loss the tail computes, its gradient at the tail's input and the weights
after ten steps):
``max|web - torch| / max(max|torch|, 1e-6)``. PyTorch is computed here, never copied.

The runtime is the bundle ``make web`` builds (web/dist/device.js), in Debian's Chromium
(Playwright drives the system binary; it cannot download its own). Every zoo model and cut
on ``wasm``, the backend a phone's page starts on; the U-shaped tails and the trunk tests
(test_web_trunk.py) on ``webgl`` too, where this Chromium gives it a context (SwiftShader);
the mixed stage, the refusal and the privacy cases on every backend, ``cpu`` included (the
last a page falls back to). The whole matrix on ``cpu`` and SwiftShader's ``webgl`` would
cost the test command about two minutes on two cores: their kernels take 6-18 times
``wasm``'s time (benchmarks/web_step.py).
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import sync_playwright
from torch import nn

from protocols import protocol_named
from splitlearn.models import build_model
from splitlearn.privacy.mechanism import clip_per_sample
from splitlearn.stages import split
from splitlearn.web import decode_tensor, describe_stages, encode_tensor, state_from_web

# Chromium with SwiftShader takes more than a core: two of these beside each other on the
# two-core host took 134 s where one took 67 (2026-12-05). In the serial phase the file
# runs in one lane, one test at a time (tests/conftest.py: LANES).
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "web" / "dist" / "device.js"
BACKENDS = ("wasm", "webgl", "cpu")
#: The backend a phone's page starts on, through every model and cut.
MATRIX_BACKENDS = ("wasm",)
#: The backends a phone with WebAssembly or a GPU trains on.
PHONE_BACKENDS = ("wasm", "webgl")
#: No GPU; WebGL from SwiftShader, the software renderer Chromium ships.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--use-angle=swiftshader",
                 "--enable-unsafe-swiftshader", "--disable-dev-shm-usage"]
TOLERANCE = 1e-4
STEPS = 10
BATCH = 8
CUT_GRAD_SCALE = 0.01
SGD = {"lr": 0.05, "momentum": 0.5, "weight_decay": 1e-4}

#: (model, in_channels, image_size, cut): SmallCNN at every cut on the shipped digits' shape,
#: LeNet-5 at every cut on MNIST's (28x28 pads its convolutions), the small ResNet's stem
#: (BatchNorm) on CIFAR-10's.
CASES = ([("cnn", 1, 8, cut) for cut in range(1, 5)]
         + [("lenet5", 1, 28, cut) for cut in range(1, 5)]
         + [("resnet", 3, 32, 1)])


def mixed_stage() -> tuple[nn.Sequential, tuple[int, int, int]]:
    """The layers no zoo model above has: ReLU6, average pools, dropout, a strided conv."""
    torch.manual_seed(3)
    stage = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(),
        nn.AvgPool2d(2), nn.MaxPool2d(3, stride=1, padding=1), nn.Identity(), nn.Flatten(),
        nn.Linear(8 * 4 * 4, 32), nn.ReLU(), nn.Dropout(0.25), nn.Linear(32, 16),
    )
    nn.init.constant_(stage[1].weight, 4.0)  # ReLU6 clips some of the normalised values
    return stage, (3, 16, 16)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not BUNDLE.exists():
        pytest.fail(f"{BUNDLE.relative_to(ROOT)} is missing: run `make web`")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("no chromium on PATH: run `make web` (it installs Debian's)")
    with sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module", params=BACKENDS)
def page(browser, request) -> Iterator[object]:
    """A page with the bundle loaded, on one TensorFlow.js backend."""
    opened = browser.new_page()
    opened.set_content("<!doctype html><title>splitlearn web device</title>")
    opened.add_script_tag(path=str(BUNDLE))
    if not opened.evaluate("b => splitlearnDevice.setBackend(b)", request.param):
        opened.close()
        pytest.skip(f"TensorFlow.js's {request.param} backend does not start in this Chromium")
    yield opened
    opened.close()


def relative(web: torch.Tensor, reference: torch.Tensor) -> float:
    assert web.shape == reference.shape, (web.shape, reference.shape)
    scale = max(reference.abs().max().item(), 1e-6)
    return (web - reference.to(web.dtype)).abs().max().item() / scale


def run_beside_pytorch(page, bottom: nn.Module, input_shape: tuple[int, ...],
                       seed: int) -> dict[str, float]:
    """Train ``bottom`` in the page and in PyTorch; the worst relative difference of each kind."""
    description = describe_stages(bottom, input_shape)
    page.evaluate("([d, o]) => { globalThis.dev?.dispose(); "
                  "globalThis.dev = splitlearnDevice.load(d, o); }", [description, SGD])
    optimizer = torch.optim.SGD(bottom.parameters(), **SGD)
    dropouts = {name: m for name, m in bottom.named_modules() if isinstance(m, nn.Dropout)}
    masks: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda m, args, out, name=name: args[0] * masks[name])
             for name, m in dropouts.items()]
    initial = copy.deepcopy(bottom.state_dict())
    g = torch.Generator().manual_seed(seed)
    worst = {"activations": 0.0, "gradients": 0.0, "weights": 0.0, "updates": 0.0}
    try:
        for _ in range(STEPS):
            inputs = torch.randn(BATCH, *input_shape, generator=g)
            web_out = decode_tensor(page.evaluate("x => dev.forward(x)", encode_tensor(inputs)))
            masks.update({name: decode_tensor(mask) for name, mask in
                          page.evaluate("() => dev.dropoutMasks()").items()})
            out = bottom(inputs)
            worst["activations"] = max(worst["activations"], relative(web_out, out))
            # About the size of a mean loss's gradient at a cut: the steps stay small.
            cut_grad = CUT_GRAD_SCALE * torch.randn(out.shape, generator=g) / BATCH
            web_grads = page.evaluate("g => dev.backwardFromCutGradient(g)",
                                      encode_tensor(cut_grad))
            optimizer.zero_grad()
            torch.autograd.backward(out, cut_grad)
            params = dict(bottom.named_parameters())
            assert sorted(web_grads) == sorted(params)
            for name, param in params.items():
                diff = relative(decode_tensor(web_grads[name]), param.grad)
                worst["gradients"] = max(worst["gradients"], diff)
            page.evaluate("() => dev.step()")
            optimizer.step()
    finally:
        for hook in hooks:
            hook.remove()
    web_state = state_from_web(page.evaluate("() => dev.state()"))
    reference = bottom.state_dict()
    assert sorted(web_state) == sorted(reference)
    for name, value in reference.items():
        if value.dtype == torch.long:  # BatchNorm's num_batches_tracked
            assert int(web_state[name]) == int(value), name
        else:
            worst["weights"] = max(worst["weights"], relative(web_state[name], value))
            # What the ten steps changed, so that a wrong step cannot hide in the weights.
            worst["updates"] = max(worst["updates"], relative(web_state[name] - initial[name],
                                                              value - initial[name]))
    return worst


@pytest.mark.parametrize("page", MATRIX_BACKENDS, indirect=True)
@pytest.mark.parametrize(("model_name", "channels", "size", "cut"), CASES,
                         ids=[f"{m}-{s}px-cut{c}" for m, _, s, c in CASES])
def test_the_web_step_trains_a_models_stages_as_pytorch(page, model_name, channels, size, cut):
    model = build_model(model_name, in_channels=channels, image_size=size, num_classes=10,
                        seed=0)
    bottom = copy.deepcopy(split(model, cut)[0]).train()
    worst = run_beside_pytorch(page, bottom, model.input_shape, seed=cut)
    print(f"{page.evaluate('splitlearnDevice.backend()')} {model_name} cut {cut}: {worst}")
    assert max(worst.values()) < TOLERANCE, worst


#: (model, in_channels, image_size): each zoo model the runtime trains, for its U-shaped tail.
TAILS = [("cnn", 1, 8), ("lenet5", 1, 28), ("resnet", 3, 32)]


@pytest.mark.parametrize("page", PHONE_BACKENDS, indirect=True)
@pytest.mark.parametrize(("model_name", "channels", "size"), TAILS,
                         ids=[f"{m}-{s}px" for m, _, s in TAILS])
def test_the_ushaped_tail_computes_the_loss_and_trains_as_pytorch(page, model_name, channels,
                                                                 size):
    """The U-shaped step's own part: the tail's loss, its input gradient (what goes back to
    the trunk) and ten SGD steps, on the features the trunk would send."""
    model = build_model(model_name, in_channels=channels, image_size=size, num_classes=10,
                        seed=0)
    protocol = protocol_named("ushaped")
    first = protocol.first_tail_stage(protocol.options(), model.num_stages)
    tail = copy.deepcopy(nn.Sequential(*list(model.stages)[first:])).train()
    features = tuple(model.cut_shape(first))
    page.evaluate("([d, o]) => { globalThis.dev?.dispose(); "
                  "globalThis.dev = splitlearnDevice.load(d, o); }",
                  [describe_stages(tail, features), SGD])
    optimizer = torch.optim.SGD(tail.parameters(), **SGD)
    g = torch.Generator().manual_seed(first)
    worst = {"loss": 0.0, "input gradient": 0.0, "weights": 0.0}
    for _ in range(STEPS):
        x = torch.randn(BATCH, *features, generator=g).requires_grad_()
        y = torch.randint(0, 10, (BATCH,), generator=g)
        web = page.evaluate("""([x, y]) => { dev.forward(x); const r = dev.lossBackward(y);
            dev.step(); return {loss: r.loss, correct: r.correct,
                                grad: splitlearnDevice.encode(r.inputGrad)}; }""",
                            [encode_tensor(x.detach()), y.tolist()])
        optimizer.zero_grad()
        logits = tail(x)
        loss = nn.functional.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        worst["loss"] = max(worst["loss"], abs(web["loss"] - loss.item()) / loss.item())
        worst["input gradient"] = max(worst["input gradient"],
                                      relative(decode_tensor(web["grad"]), x.grad))
        assert web["correct"] == int((logits.argmax(1) == y).sum())
    web_state = state_from_web(page.evaluate("() => dev.state()"))
    for name, value in tail.state_dict().items():
        if value.is_floating_point():
            worst["weights"] = max(worst["weights"], relative(web_state[name], value))
    print(f"{page.evaluate('splitlearnDevice.backend()')} {model_name} tail: {worst}")
    assert max(worst.values()) < TOLERANCE, worst


def test_relu6_pools_dropout_and_a_strided_conv_train_as_in_pytorch(page):
    stage, input_shape = mixed_stage()
    worst = run_beside_pytorch(page, stage.train(), input_shape, seed=7)
    print(f"{page.evaluate('splitlearnDevice.backend()')} mixed: {worst}")
    assert max(worst.values()) < TOLERANCE, worst


def test_the_runtime_refuses_a_layer_type_it_does_not_know_by_name(page):
    description = describe_stages(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (4,))
    description["layers"][1] = {"type": "GELU", "name": "1", "module": "GELU"}
    with pytest.raises(PlaywrightError, match=r"unsupported layer type 'GELU' at layer 1 \(1\)"):
        page.evaluate("([d, o]) => { splitlearnDevice.load(d, o); }", [description, SGD])


def test_a_released_batch_is_clipped_as_pytorch_clips_and_trains_through_the_clip(page):
    """privacy=activation_gaussian on a phone: each row clipped to C as
    splitlearn/privacy/mechanism.py clips it, the backward through the clip (no noise here)."""
    model = build_model("cnn", in_channels=1, image_size=8, num_classes=10, seed=0)
    bottom = copy.deepcopy(split(model, 2)[0]).train()
    g = torch.Generator().manual_seed(3)
    inputs = torch.randn(BATCH, *model.input_shape, generator=g)
    with torch.no_grad():  # C between the rows' norms: some rows clipped, some not
        clip = bottom(inputs).flatten(1).norm(dim=1).median().item()
    page.evaluate("([d, o, r]) => { globalThis.dev?.dispose(); "
                  "globalThis.dev = splitlearnDevice.load(d, o, r); }",
                  [describe_stages(bottom, model.input_shape), SGD,
                   {"clip_norm": clip, "noise_std": 0.0}])
    web_out = decode_tensor(page.evaluate("x => dev.forward(x)", encode_tensor(inputs)))
    out = clip_per_sample(bottom(inputs), max_norm=clip)
    assert relative(web_out, out) < TOLERANCE
    cut_grad = CUT_GRAD_SCALE * torch.randn(out.shape, generator=g) / BATCH
    web_grads = page.evaluate("g => dev.backwardFromCutGradient(g)", encode_tensor(cut_grad))
    torch.autograd.backward(out, cut_grad)
    for name, param in bottom.named_parameters():
        assert relative(decode_tensor(web_grads[name]), param.grad) < TOLERANCE, name


def test_a_released_batch_carries_fresh_gaussian_noise_of_the_asked_deviation(page):
    model = build_model("cnn", in_channels=1, image_size=8, num_classes=10, seed=0)
    bottom = copy.deepcopy(split(model, 2)[0]).train()
    inputs = torch.randn(BATCH, *model.input_shape, generator=torch.Generator().manual_seed(4))
    clip, std = 1.0, 0.5
    page.evaluate("([d, o, r]) => { globalThis.dev?.dispose(); "
                  "globalThis.dev = splitlearnDevice.load(d, o, r); }",
                  [describe_stages(bottom, model.input_shape), SGD,
                   {"clip_norm": clip, "noise_std": std}])
    clipped = clip_per_sample(bottom(inputs), max_norm=clip).detach()
    noises = [decode_tensor(page.evaluate("x => dev.forward(x)", encode_tensor(inputs))) - clipped
              for _ in range(2)]
    for noise in noises:  # mean 0 and std 0.5, each within 5 standard errors
        n = noise.numel()
        assert abs(noise.mean().item()) < 5 * std / n**0.5
        assert abs(noise.std().item() - std) < 5 * std / (2 * n) ** 0.5
    assert not torch.equal(noises[0], noises[1])  # fresh noise every release
