"""Phones join from a browser: headless Chromium pages as Flower nodes, through the gateway.

On Flower's Deployment Engine with TLS and SuperNode authentication (the deployment tests'
SuperLink), ``python -m clients.gateway`` holds a registered SuperNode per phone, and each
phone is a Chromium page at a phone's viewport (Playwright, Debian's Chromium) that opened
the join URL the gateway printed and consented. Python devices join beside them with
``clients.connect``. The run is ``flwr run`` with ``devices.web=true``; the trunk serves its
WebSocket over TLS, which the pages reach directly.

- Two phones and a Python device train the default job for a round: every phone has
  ``ok`` rows with its own node id, its bytes and its time per batch, and each device's
  training loss and the run's final accuracy are those of three Python devices with the
  same seed (in process). The job's trunk is one copy per device (``strategy=splitfed_v1``):
  with one shared trunk (the default, SplitFed v2) the batches interleave in arrival order,
  and two all-Python runs of the same seed already differ by 1.7 points after three rounds
  (0.858 to 0.875, measured), which would hide what is compared: the phones' arithmetic.
  ``pytest -m must_show tests/integration/test_gateway.py`` runs the same check with three
  phones and two Python devices for three rounds (not in the test command: its time).
- Then, on the same federation, the default job with its cuts planned by DynSL each round
  (``planner=dynsl``): a phone that closes its page mid-round is ``lost`` and the round
  completes with the others; the page opened again rejoins as the same node and trains the
  next rounds. The other phone's CPU is throttled 6x (the DevTools protocol's
  ``Emulation.setCPUThrottlingRate``): from the times it measured, the planner moves it to a
  smaller cut than its first (the prior's), never deeper than the other phone's. (Whether
  the other stays deeper depends on the CPU each page gets: beside the other serial lanes
  both may measure slow enough for cut 1. ``pytest -m must_show -k throttled`` checks it
  with both phones present for three rounds, on a host with nothing else running.) A page
  keeps its partition's rows from run to run (its later tasks carry none); one opened again
  gets them once more. A forged or expired join token is refused with its reason, and so is
  a page that sends the gateway garbage.
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.app import build_client_app
from experiments.central import free_port
from experiments.certificates import make_node_key
from experiments.local import LocalGrid
from protocols import compose_config
from server.app import run_training, start_runtime, stop_runtime
from tests.integration.test_deployment import (  # noqa: F401 - the deployment fixture
    Processes,
    deployment,
    flwr,
    online_nodes,
    recorded_rounds,
    start_run,
    tls_overrides,
)
from tests.integration.test_deployment_docs import batches_done
from tests.integration.test_simulation import read_clients
from tests.processes import wait_for

pytestmark = pytest.mark.serial

PHONE = {"viewport": {"width": 390, "height": 844}, "device_scale_factor": 2, "is_mobile": True,
         "has_touch": True, "ignore_https_errors": True}  # the test CA's trunk (wss)
RUN = ["num_clients={n}", "devices.web=true", "dataplane.websocket_port=0", "logger=none",
       "logger.plots=false", "strategy.num_rounds=2", "strategy.local_epochs=1",
       "strategy.round_timeout_s=150"]


@pytest.fixture(scope="module")
def chromium() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail("no chromium on PATH: run `make web` (it installs Debian's)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable,
                                     args=["--no-sandbox", "--ignore-certificate-errors"])
        yield browser
        browser.close()


def register_keys(env, folder: Path, names: list[str]) -> list[Path]:
    """A SuperNode key per name, registered with the SuperLink; the private keys."""
    keys = []
    for name in names:
        private, public = make_node_key(folder, name)
        registered = flwr("supernode", "register", str(public), "--format", "json", env=env)
        assert registered.returncode == 0, registered.stdout + registered.stderr
        keys.append(private)
    return keys


def start_gateway(processes: Processes, env, tmp_path: Path, *, port: int, ca: Path,
                  keys: list[Path], first: int, partitions: int, ttl_s: float = 3600) -> str:
    """``python -m clients.gateway`` with a registered key per phone; the join URL it prints."""
    processes.start("gateway", [
        sys.executable, "-m", "clients.gateway", "--superlink", f"127.0.0.1:{port}",
        "--root-certificates", str(ca), *[f"--auth-key={key}" for key in keys],
        "--first-partition", str(first), "--num-partitions", str(partitions),
        "--port", str(free_port()), "--token-ttl", str(ttl_s), "--qr", str(tmp_path / "join.png"),
        "--logs", str(tmp_path), "--cache-dir", str(tmp_path / "phone-caches")], env)
    log = tmp_path / "gateway.log"
    wait_for(lambda: "phones join at" in log.read_text(), "the gateway's join URL")
    assert (tmp_path / "join.png").read_bytes().startswith(b"\x89PNG")
    return re.search(r"phones join at (\S+)", log.read_text()).group(1)


def open_phone(chromium, url: str, *, context=None):  # noqa: ANN001, ANN201
    """A phone's page at ``url``: consented, connected (or turned away: see its state).

    On the backend the page picks by itself: TensorFlow.js's ``wasm``, the fastest on a CPU.
    """
    context = context or chromium.new_context(**PHONE)
    page = context.new_page()
    page.tasks = []  # each task the page got: whether it carried the partition's rows
    page.on("websocket", lambda socket: socket.on("framereceived", lambda frame: (
        page.tasks.append('"inputs"' in frame)
        if isinstance(frame, str) and frame.startswith('{"task"') else None)))
    page.goto(url)
    page.wait_for_function("document.getElementById('backend').textContent !== '-'")
    assert page.inner_text("#backend") == "wasm"
    if page.is_visible("#join"):  # a page that joined before goes on by itself
        page.click("#join")
    return page


def state_of(page) -> str:  # noqa: ANN001
    return page.inner_text("#state")


def wait_connected(pages: list) -> None:
    for page in pages:
        wait_for(lambda page=page: state_of(page).startswith("connected"), "a phone connected",
                 timeout_s=60)


def start_python_device(processes: Processes, env, *, index: int, count: int, port: int,
                        ca: Path, key: Path, cache: Path) -> None:
    """A Python device (``clients.connect``) training partition ``index`` of ``count``."""
    processes.start(f"device-{index}", [
        sys.executable, "-m", "clients.connect", "--superlink", f"127.0.0.1:{port}",
        "--profile", "raspberry_pi_4", "--cache-dir", str(cache), "--root-certificates", str(ca),
        "--auth-key", str(key), "--partition-id", str(index), "--num-partitions", str(count),
        "--port", str(free_port()), "--max-wait-time", "60"], env)


def run_to_end(run_dir: Path, overrides: list[str], env, *, timeout_s: float = 500) -> None:
    run = start_run(run_dir, overrides, env)
    output, _ = run.communicate(timeout=timeout_s)
    assert run.returncode == 0, output[-3000:]


def python_devices_result(tmp_path: Path, overrides: list[str]) -> dict:
    """The last round of the same run with only Python devices, in process (the reference)."""
    cfg = compose_config(overrides)
    cfg.run_dir = str(tmp_path / "reference")
    runtime = start_runtime(cfg)
    try:
        grid = LocalGrid(build_client_app(), num_nodes=cfg.num_clients, concurrency=2)
        run_training(grid, runtime)
    finally:
        stop_runtime(runtime)
    return recorded_rounds(tmp_path / "reference")[-1]


def join(deployment, chromium, tmp_path: Path, *, phones: int, devices: int,  # noqa: ANN001, F811
         ttl_s: float) -> tuple[str, float, list]:
    """``devices`` Python devices and ``phones`` pages (through the gateway) online.

    The Python devices hold the first partitions, the phones the last. Returns the join
    URL, when its token was issued, and the pages.
    """
    files, env, port, processes = deployment
    count = phones + devices
    keys = register_keys(env, tmp_path / "keys", [f"device{i}" for i in range(devices)])
    for i, key in enumerate(keys):
        start_python_device(processes, env, index=i, count=count, port=port, ca=files.ca,
                            key=key, cache=tmp_path / f"cache{i}")
    phone_keys = register_keys(env, tmp_path / "keys", [f"phone{i}" for i in range(phones)])
    url = start_gateway(processes, env, tmp_path, port=port, ca=files.ca, keys=phone_keys,
                        first=devices, partitions=count, ttl_s=ttl_s)
    issued = time.time()
    pages = [open_phone(chromium, url) for _ in range(phones)]
    wait_connected(pages)
    wait_for(lambda: len(online_nodes(env)) == count, f"{count} nodes online", timeout_s=90)
    return url, issued, pages


def train_beside_python_devices(  # noqa: ANN001 - the fixtures' objects
        deployment, chromium, tmp_path: Path, *, phones: int, devices: int, rounds: int,  # noqa: F811
        ttl_s: float, epochs: int = 1) -> tuple[str, float, list, dict[str, str]]:
    """``phones`` pages and ``devices`` Python devices train ``rounds`` rounds, checked.

    Every row ``ok``, each phone its own node, its bytes and time per batch, its rows sent
    with its first task only, and every device's training loss and the final accuracy
    those of the same run with Python devices only. Returns the join URL, when its token
    was issued, the pages and each phone partition's node id.
    """
    files, env, _, _ = deployment
    count = phones + devices
    url, issued, pages = join(deployment, chromium, tmp_path, phones=phones, devices=devices,
                              ttl_s=ttl_s)
    overrides = [o.format(n=count) for o in RUN
                 if not o.startswith(("strategy.num_rounds", "strategy.local_epochs"))]
    overrides += [f"strategy.num_rounds={rounds}", f"strategy.local_epochs={epochs}",
                  "strategy=splitfed_v1"]
    run_to_end(tmp_path / "run", [*overrides, *tls_overrides(files)], env)
    rows = read_clients(tmp_path / "run")
    assert [r["status"] for r in rows] == ["ok"] * count * rounds
    phone_rows = [r for r in rows if int(r["partition_id"]) >= devices]
    node_of = {r["partition_id"]: r["node_id"] for r in phone_rows}
    assert len(set(node_of.values())) == phones
    assert sorted(node_of) == [str(p) for p in range(devices, count)]
    assert {(r["partition_id"], r["node_id"]) for r in phone_rows} == set(node_of.items())
    for row in phone_rows:
        assert row["profile"] == "mid_range_phone"
        assert int(row["steps"]) == int(row["round_steps"]) > 0  # the whole round
        assert int(row["bytes_up"]) > int(row["weights_bytes_up"]) > 0  # smashed data, over wss
        assert float(row["compute_s"]) > 0 and float(row["peak_memory_bytes"]) > 0
    assert [page.inner_text("#round") for page in pages] == [str(rounds)] * phones
    # Each phone got its rows with its first task only: it held them after.
    assert [page.tasks for page in pages] == [[True] + [False] * (rounds - 1)] * phones
    # The phones trained their partitions' batches in a Python device's order, with the
    # same arithmetic (within float32): Python devices in every place train alike.
    reference = python_devices_result(tmp_path, overrides)
    expected = {(r["round"], r["partition_id"]): float(r["train_loss"])
                for r in read_clients(tmp_path / "reference")}
    for row in rows:
        loss = expected[(row["round"], row["partition_id"])]
        assert float(row["train_loss"]) == pytest.approx(loss, rel=1e-3), row["partition_id"]
    final = recorded_rounds(tmp_path / "run")[-1]
    print(f"{phones} phones and {devices} Python devices, {rounds} rounds: final accuracy "
          f"{final['test_accuracy']:.4f}, loss {final['test_loss']:.4f}; Python devices only: "
          f"{reference['test_accuracy']:.4f}, {reference['test_loss']:.4f}")
    assert abs(final["test_accuracy"] - reference["test_accuracy"]) <= 0.01 + 1e-9
    # The model the phones' trained stages joined tests as the reference's does.
    assert final["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-3)
    return url, issued, pages, node_of


@pytest.mark.must_show
def test_three_phones_and_two_python_devices_train_three_rounds_as_five_python_devices(
        deployment, chromium, tmp_path):  # noqa: F811
    """The issue's own sizes, two local epochs as the default job (not in the test command)."""
    train_beside_python_devices(deployment, chromium, tmp_path, phones=3, devices=2, rounds=3,
                                ttl_s=3600, epochs=2)


@pytest.mark.must_show
def test_a_phone_throttled_6x_gets_a_smaller_cut_than_an_unthrottled_one(
        deployment, chromium, tmp_path):  # noqa: F811
    """DynSL plans from what the phones measured (not in the test command: see the docstring).

    Which cut a phone gets weighs its measured compute against its link and the trunk, so
    the unthrottled phone keeps a deep cut only while its page gets a core of its own: run
    it with nothing else on the host. The round's time alone decides here
    (``planner.learning_penalty=0``): weighed by what cuts teach, the default job's rounds
    are short enough that both phones train at cut 1 from round 2.
    """
    files, env, _, _ = deployment
    _, _, (fast, throttled) = join(deployment, chromium, tmp_path, phones=2, devices=1,
                                   ttl_s=3600)
    throttled.context.new_cdp_session(throttled).send("Emulation.setCPUThrottlingRate",
                                                      {"rate": 6})
    run_dir = tmp_path / "planned"
    planned = [o.format(n=3) for o in RUN if not o.startswith("strategy.num_rounds")]
    run_to_end(run_dir, [*planned, "strategy.num_rounds=3", "planner=dynsl", "planner.every=1",
                         "planner.learning_penalty=0", *tls_overrides(files)], env)
    rows = {(r["round"], r["partition_id"]): r for r in read_clients(run_dir)}
    assert {r["status"] for r in rows.values()} == {"ok"}
    cuts = [[int(rows[(r, p)]["cut"]) for p in "12"] for r in "123"]
    per_batch = [[float(rows[(r, p)]["compute_s"]) / int(rows[(r, p)]["steps"]) for p in "12"]
                 for r in "123"]
    print("cuts by round (unthrottled, throttled):", cuts, "seconds per batch:", per_batch)
    assert cuts[0][0] == cuts[0][1]  # the prior's cut for both, before any measurement
    assert all(slow < fast for fast, slow in cuts[1:]), cuts


def test_phones_train_as_python_devices_leave_mid_round_and_rejoin_as_the_same_node(
        deployment, chromium, tmp_path):  # noqa: F811
    files, env, _, _ = deployment
    ttl_s = 30  # the phones join at once; the link has expired by the end of the second run
    # 1. One round, every device: the phones train as Python devices do.
    url, issued, phones, node_of = train_beside_python_devices(
        deployment, chromium, tmp_path, phones=2, devices=1, rounds=1, ttl_s=ttl_s)
    # A forged token and a page that sends the gateway garbage are turned away by reason.
    forged = open_phone(chromium, url.replace("token=", "token=1"))
    wait_for(lambda: "not joined: the join token is not this gateway's" in state_of(forged),
             "a forged token refused")
    closed = phones[0].evaluate("""url => new Promise(done => {
        const socket = new WebSocket(url);
        socket.onopen = () => socket.send("{not json");
        socket.onclose = (event) => done([event.code, event.reason]);
    })""", url.split("?")[0].replace("http", "ws") + "phone")
    assert closed == [4401, 'a hello is {"join": token}']

    # 2. The default job planned by DynSL: a phone's page closes a few batches into round 1;
    # the other phone runs at a sixth of its CPU's speed.
    leaving, throttled = phones
    throttled.context.new_cdp_session(throttled).send("Emulation.setCPUThrottlingRate",
                                                      {"rate": 6})
    run_dir = tmp_path / "faults"
    planned = [o.format(n=3) for o in RUN if not o.startswith("strategy.num_rounds")]
    run = start_run(run_dir, [*planned, "strategy.num_rounds=3", "planner=dynsl",
                              "planner.every=1", *tls_overrides(files)], env)
    wait_for(lambda: state_of(leaving) == "training round 1" and batches_done(leaving) >= 3,
             "round 1 under way", timeout_s=300)
    context = leaving.context
    leaving.close()
    wait_for(lambda: len(recorded_rounds(run_dir)) >= 2, "round 1 recorded", timeout_s=300)
    back = open_phone(chromium, url, context=context)  # the page kept its place
    output, _ = run.communicate(timeout=400)
    assert run.returncode == 0, output[-3000:]
    rows = {(r["round"], r["partition_id"]): r for r in read_clients(run_dir)}
    assert rows[("1", "1")]["status"] == "lost"
    assert "left mid-round" in rows[("1", "1")]["reason"]
    assert [rows[("1", p)]["status"] for p in "02"] == ["ok"] * 2  # the round completed
    assert [rows[(r, p)]["status"] for r in "23" for p in "012"] == ["ok"] * 6
    assert rows[("2", "1")]["node_id"] == node_of["1"]  # the same node again
    assert back.inner_text("#round") == "3"
    # A page keeps its rows from run to run; one opened again gets them once more.
    assert throttled.tasks == [True, False, False, False]
    assert back.tasks == [True, False]

    # The link has expired by now: a new phone is refused with that reason.
    time.sleep(max(0.0, issued + ttl_s + 1 - time.time()))
    late = open_phone(chromium, url)
    wait_for(lambda: "not joined: the join token expired" in state_of(late),
             "an expired token refused")
    # The throttled phone's measured time moved it to a smaller cut than the prior's, and
    # it is never deeper than the other phone. (Whether the other stays deeper depends on
    # the CPU its page gets: see the module docstring.)
    cuts = [[int(rows[(r, p)]["cut"] or 0) for p in "12"] for r in "123"]
    print("cuts by round (the phone that left, the throttled one):", cuts)
    assert cuts[2][1] < cuts[0][1], cuts
    assert all(throttled_cut <= other for other, throttled_cut in cuts[1:]), cuts
