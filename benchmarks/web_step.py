"""The web runtime's training step against eager PyTorch, per model, cut and backend.

``python -m benchmarks web-step [--models cnn lenet5 resnet]``

For every model the web runtime can train and every cut it can train it at (the ResNets at
their stem), one device step (forward, backward from a given gradient at the cut, SGD with
momentum and weight decay) on a batch of the run's size, in headless Chromium (Debian's,
driven by Playwright, the bundle ``web/dist/device.js``) on each TensorFlow.js backend that
starts there (``cpu``, ``wasm``, ``webgl``; ``webgpu`` is tried and listed as not started
while the bundle does not carry it), and in eager PyTorch in this process with one
thread (a phone-class core). After 5 warm-up steps, the median of 30. WebGL in a headless
Chromium without a GPU is SwiftShader (software): its numbers say nothing of a phone's GPU.

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import copy
import json
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from splitlearn.models import build_model
from splitlearn.stages import split
from splitlearn.web import describe_stages, encode_tensor, stages_refusal

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "web" / "dist" / "device.js"
SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
#: Model name -> (input channels, image size) as the zoo's small jobs train them.
MODELS = {"cnn": (1, 8), "lenet5": (1, 28), "resnet": (3, 32)}
BACKENDS = ("cpu", "wasm", "webgl", "webgpu")
WARMUP, STEPS, BATCH = 5, 30, 32

TIMED = f"""([d, o, x, g]) => {{
    const dev = splitlearnDevice.load(d, o);
    const [xv, gv] = [splitlearnDevice.values(x), splitlearnDevice.values(g)];
    const times = [];
    for (let i = 0; i < {WARMUP + STEPS}; i++) {{
        const t = performance.now();
        dev.forwardValues(xv, "train"); dev.backward(gv); dev.step();
        times.push(performance.now() - t);
    }}
    dev.dispose();
    return times.slice({WARMUP});
}}"""


def eager_ms(bottom: nn.Module, inputs: torch.Tensor, grad: torch.Tensor) -> float:
    """Median milliseconds of the same step in eager PyTorch, one thread."""
    optimizer = torch.optim.SGD(bottom.parameters(), **SGD)
    times = []
    for i in range(WARMUP + STEPS):
        started = time.perf_counter()
        optimizer.zero_grad()
        torch.autograd.backward(bottom(inputs), grad)
        optimizer.step()
        if i >= WARMUP:
            times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def cases(models: Sequence[str]) -> list[tuple[str, int, nn.Module, tuple[int, ...]]]:
    """Every (model, cut) the web runtime trains, with its device stages and input shape."""
    found = []
    for name in models:
        channels, size = MODELS[name]
        model = build_model(name, in_channels=channels, image_size=size, num_classes=10, seed=0)
        for cut in model.valid_cuts:
            bottom = copy.deepcopy(split(model, cut)[0]).train()
            if stages_refusal(bottom, model.input_shape) is None:
                found.append((name, cut, bottom, tuple(model.input_shape)))
    return found


def bench_web_step(models: Sequence[str]) -> list[dict]:
    """Time every case on every backend that starts; print and return the rows."""
    from playwright.sync_api import sync_playwright

    torch.set_num_threads(1)
    rows = []
    print(f"{'model':>7} {'cut':>4} {'backend':>8} {'web ms':>8} {'eager ms':>9} {'ratio':>7}",
          flush=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=shutil.which("chromium"),
                                     args=["--no-sandbox", "--enable-unsafe-webgpu"])
        for name, cut, bottom, shape in cases(models):
            g = torch.Generator().manual_seed(cut)
            inputs = torch.randn(BATCH, *shape, generator=g)
            grad = torch.randn(bottom(inputs).shape, generator=g) / BATCH
            eager = eager_ms(copy.deepcopy(bottom), inputs, grad)
            description = describe_stages(bottom, shape)
            for backend in BACKENDS:
                page = browser.new_page()
                page.set_content("<!doctype html><title>web step</title>")
                page.add_script_tag(path=str(BUNDLE))
                if page.evaluate("b => splitlearnDevice.setBackend(b)", backend):
                    times = page.evaluate(TIMED, [description, SGD, encode_tensor(inputs),
                                                  encode_tensor(grad)])
                    web = statistics.median(times)
                    rows.append({"model": name, "cut": cut, "backend": backend, "web_ms": web,
                                 "eager_ms": eager, "ratio": web / eager})
                    print(f"{name:>7} {cut:>4} {backend:>8} {web:>8.1f} {eager:>9.2f} "
                          f"{web / eager:>7.1f}", flush=True)
                else:  # not in the bundle (webgpu), or no adapter for it in this browser
                    print(f"{name:>7} {cut:>4} {backend:>8} {'did not start':>26}", flush=True)
                page.close()
        browser.close()
    print(json.dumps(rows))
    return rows
