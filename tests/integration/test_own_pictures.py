"""A phone trains on its person's own pictures, labelled on its page; they never leave it.

The page (web/public/index.html with web/dist/page.js, in Debian's Chromium at a phone's
size) keeps each picture it is given as a small square and turns it into the run's input
when a task asks (web/src/pictures.ts): luma for a grey dataset, the average over each
output pixel's area, a light-bordered grey picture inverted (the grey datasets are light
on dark). That conversion is held here to a NumPy version of the same definition.

Then a whole run: the gateway (in process; the phone's ClientApp runs in process too,
LocalGrid standing in for the slot's SuperNode) and a page that was given 30 digit pictures
drawn as ink on paper, labelled on the page, with a Python device beside it. The phone's
tasks carry no rows; its rows are ``ok`` with its pictures' count; and its training loss
each round equals that of a Python device given the same pictures as a parquet file
(``data-path``) converted by the NumPy version, with the same seed: the page trained what
its person picked, as PyTorch would.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clients.app import DATA_KEY, build_client_app
from clients.device import PROFILE_KEY
from clients.gateway import Gateway, parse_args
from clients.relay import RELAY_KEY, RUNTIME_KEY, SECRET_KEY, SLOT_KEY, WEB_RUNTIME
from experiments.local import LocalGrid
from protocols import compose_config
from server.app import run_training, start_runtime, stop_runtime
from tests.integration.test_simulation import read_clients
from tests.integration.test_web_step import browser  # noqa: F401 - the fixture
from tests.processes import wait_for

pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "web" / "dist" / "device.js"
PHONE = {"viewport": {"width": 390, "height": 844}, "device_scale_factor": 2,
         "is_mobile": True, "has_touch": True}
#: The job: the default, one trunk per device (its batches in a fixed order), two rounds.
RUN = ["num_clients=2", "devices.web=true", "dataplane.websocket_port=0", "logger=none",
       "logger.plots=false", "strategy=splitfed_v1", "strategy.num_rounds=2",
       "strategy.local_epochs=1", "strategy.round_timeout_s=120"]
PICTURES = 30


def area_weights(source: int, size: int) -> np.ndarray:
    """(size, source): the share of source pixel j that output pixel i averages."""
    scale = source / size
    weights = np.zeros((size, source))
    for i in range(size):
        start, end = i * scale, (i + 1) * scale
        for j in range(int(np.floor(start)), min(int(np.ceil(end)), source)):
            weights[i, j] = (min(end, j + 1) - max(start, j)) / scale
    return weights


def reference_values(rgba: np.ndarray, channels: int, size: int, light_on_dark: bool
                     ) -> np.ndarray:
    """web/src/pictures.ts's pictureValues in NumPy: (channels, size, size) float32."""
    rgb = rgba[..., :3].astype(np.float64)
    planes = ([(0.299 * rgb[..., 0] + 0.587 * rgb[..., 1] + 0.114 * rgb[..., 2]) / 255]
              if channels == 1 else [rgb[..., c] / 255 for c in range(3)])
    weights = area_weights(rgba.shape[0], size)
    out = []
    for plane in planes:
        border = np.concatenate([plane[0], plane[-1], plane[1:-1, 0], plane[1:-1, -1]])
        value = weights @ plane @ weights.T
        out.append(1 - value if channels == 1 and light_on_dark and border.mean() > 0.5
                   else value)
    return np.stack(out).astype(np.float32)


@pytest.mark.parametrize(("source", "channels", "size", "dark_ink"), [
    (32, 1, 8, True), (32, 1, 8, False), (20, 1, 8, True), (32, 1, 28, True),
    (8, 1, 28, False), (32, 3, 32, False), (17, 3, 8, True),
], ids=["32-to-8-ink", "32-to-8-light", "20-to-8", "32-to-28", "8-to-28", "rgb-32", "rgb-17-to-8"])
def test_a_picture_becomes_the_runs_input_as_numpy_computes_it(browser, source, channels, size,  # noqa: F811
                                                              dark_ink):
    page = browser.new_page()
    page.set_content("<!doctype html><title>pictures</title>")
    page.add_script_tag(path=str(BUNDLE))
    rng = np.random.default_rng(source * 100 + size)
    rgba = rng.integers(0, 256, (source, source, 4), dtype=np.uint8)
    if dark_ink:  # paper: a light border around darker strokes
        rgba[[0, -1], :, :3] = 250
        rgba[:, [0, -1], :3] = 250
    web = page.evaluate("([p, c, s]) => splitlearnDevice.pictureValues(p, c, s, true)",
                        [{"label": 0, "size": source, "rgba": rgba.ravel().tolist()}, channels,
                         size])
    page.close()
    expected = reference_values(rgba, channels, size, light_on_dark=True)
    np.testing.assert_allclose(np.asarray(web, np.float32).reshape(expected.shape), expected,
                               atol=1e-6)


def ink_on_paper(image: np.ndarray, scale: int = 4) -> np.ndarray:
    """A digit (8x8, values in [0, 1], light on dark) drawn dark on white, ``scale`` x larger."""
    grey = np.round(255 * (1 - image)).astype(np.uint8).repeat(scale, 0).repeat(scale, 1)
    return np.dstack([grey, grey, grey, np.full_like(grey, 255)])


class InProcessGateway(Gateway):
    """The gateway whose phone's ClientApp runs in this process (LocalGrid), not a SuperNode."""

    def _ensure_supernode(self, slot) -> None:  # noqa: ANN001 - the slot's node is LocalGrid's
        return None


def run_with_phone_node(tmp_path: Path, name: str, node_config: dict) -> Path:
    """The job with node 2's config extended by ``node_config``; its run folder."""
    cfg = compose_config(RUN)
    cfg.run_dir = str(tmp_path / name)
    runtime = start_runtime(cfg)
    try:
        grid = LocalGrid(build_client_app(), num_nodes=cfg.num_clients)
        grid.contexts[2].node_config.update(node_config)
        run_training(grid, runtime)
    finally:
        stop_runtime(runtime)
    return tmp_path / name


def test_a_phone_trains_on_its_persons_own_pictures_as_pytorch_would(browser, tmp_path):  # noqa: F811
    import datasets
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images, labels = digits.images[-PICTURES:] / 16.0, digits.target[-PICTURES:]
    folder = tmp_path / "camera"
    folder.mkdir()
    files: dict[int, list[str]] = {}
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        path = folder / f"picture-{i:02d}.png"
        Image.fromarray(ink_on_paper(image), "RGBA").save(path)
        files.setdefault(int(label), []).append(str(path))
    # The page keeps the pictures label by label, in the order they were picked.
    order = [(label, path) for label in sorted(files) for path in files[label]]

    gateway = InProcessGateway(parse_args([
        "--superlink", "127.0.0.1:1", "--insecure", "--phones", "1", "--port", "0",
        "--first-partition", "1", "--num-partitions", "2", "--logs", str(tmp_path / "logs")]))
    gateway.start()
    try:
        page = browser.new_context(**PHONE).new_page()
        tasks: list[str] = []
        page.on("websocket", lambda socket: socket.on("framereceived", lambda frame: (
            tasks.append(frame) if isinstance(frame, str) and frame.startswith('{"task"')
            else None)))
        page.goto(gateway.join_url(gateway.tokens.issue()))
        page.wait_for_function("document.getElementById('backend').textContent !== '-'")
        page.check("#own-source")
        page.click("#join")  # no pictures yet: the page asks for some and does not join
        assert "Add at least one picture" in page.inner_text("#own-count")
        notes = folder / "notes.txt"  # a file that is no picture is left out, and said so
        notes.write_text("not a picture")
        page.set_input_files("#pictures", [str(notes)])
        wait_for(lambda: "not pictures: notes.txt" in page.inner_text("#own-count"),
                 "the file refused")
        assert page.inner_text("#own-count").startswith("No pictures yet.")
        for label in sorted(files):
            page.fill("#label", str(label))
            page.set_input_files("#pictures", files[label])
            kept = f"label\u00a0{label}\u00a0\u00d7{len(files[label])}"
            wait_for(lambda kept=kept: kept in page.inner_text("#own-count"), "the pictures kept")
        assert page.inner_text("#own-count").startswith(f"{PICTURES} pictures")
        page.screenshot(path=str(tmp_path / "own-pictures.png"), full_page=True)
        page.click("#join")
        wait_for(lambda: page.inner_text("#state").startswith("connected"), "the phone joined")
        assert page.inner_text("#node") == f"place 0, {PICTURES} own pictures"

        phone = {RUNTIME_KEY: WEB_RUNTIME, RELAY_KEY: f"ws://127.0.0.1:{gateway.port}/relay",
                 SLOT_KEY: 0, SECRET_KEY: gateway.relay_secret, PROFILE_KEY: "mid_range_phone"}
        run_dir = run_with_phone_node(tmp_path, "phone", phone)
        assert page.inner_text("#round") == "2"
    finally:
        gateway.stop()
    given = [json.loads(task)["task"]["data"] for task in tasks]
    assert [(d["own"], d["shape"], "inputs" in d or "labels" in d) for d in given] == [
        (True, [PICTURES, 1, 8, 8], False)] * 2

    # The reference: a Python device given the same pictures, converted by NumPy.
    rows = [reference_values(np.asarray(Image.open(path)), 1, 8, light_on_dark=True)[0]
            for _, path in order]
    parquet = tmp_path / "own.parquet"
    datasets.Dataset.from_dict({"image": [r.tolist() for r in rows],
                                "label": [label for label, _ in order]}).to_parquet(parquet)
    reference = run_with_phone_node(tmp_path, "reference", {
        DATA_KEY: str(parquet), PROFILE_KEY: "mid_range_phone"})

    phone_rows = [r for r in read_clients(run_dir) if r["partition_id"] == "1"]
    assert [r["status"] for r in phone_rows] == ["ok", "ok"]
    assert [int(r["num_examples"]) for r in phone_rows] == [PICTURES] * 2
    expected = {(r["round"], r["partition_id"]): float(r["train_loss"])
                for r in read_clients(reference)}
    for row in read_clients(run_dir):
        assert float(row["train_loss"]) == pytest.approx(
            expected[(row["round"], row["partition_id"])], rel=1e-3), row
