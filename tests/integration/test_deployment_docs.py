"""The deployment pages run exactly as they are written, on 127.0.0.1.

``docs/how-to/deployment.md`` (its one-host part: TLS, node authentication, two devices)
and ``docs/tutorials/connect-a-device.md`` (one device, no TLS) mark the fenced ``bash``
blocks the reader types with an HTML comment (invisible on the site) right above each:
``<!-- deployment-test: ROLE [NAME] -->``.

``run``
    Runs to the end and must succeed (certificates, registering keys, ``flwr run``).
``background NAME``
    Starts something that keeps running (``superlink``, ``device-I``); the test stops its
    process group at the end, and every process it caused (found by the test's home folder
    in their environment: Flower detaches some).
``check NAME``
    A check the page asks the reader to make, run as written and its output checked:
    ``supernodes`` (run until every device is listed online) and ``run-folder``.

Each block runs through ``bash`` in the project's folder, as the pages say, with a
temporary folder as ``$HOME``: everything they put under ``~`` (certificates, the
SuperLink's working folder and so the run folder, ``~/.flwr``, the devices' caches) lands
there, and the reader's own ``~/.flwr`` is never read. The fixed ports the pages use must be
free on 127.0.0.1. What the checks expect (devices, presets, rounds, folders) is read from
the pages' own commands.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.test_deployment import Processes
from tests.processes import pids_in_environment, superlink_answers, wait_for

ROOT = Path(__file__).resolve().parents[2]
HOW_TO = ROOT / "docs" / "how-to" / "deployment.md"
TUTORIAL = ROOT / "docs" / "tutorials" / "connect-a-device.md"
PHONE_TUTORIAL = ROOT / "docs" / "tutorials" / "connect-a-phone.md"
FLWR = Path(sys.executable).with_name("flwr")
#: A marked block: the comment, then the fenced bash block right below it.
MARKED = re.compile(r"<!-- deployment-test: (?P<role>run|background|check)(?: (?P<name>[\w-]+))?"
                    r" -->\n```bash\n(?P<command>.*?)\n```", re.S)
#: Files a finished run leaves in its folder, which both pages name.
RUN_FILES = ("config.json", "metrics.json", "clients.csv", "run.log", "model.pt")


@dataclass(frozen=True)
class Step:
    """One marked block of a page, in page order."""

    role: str
    name: str
    command: str


def doc_steps(text: str, marked: re.Pattern = MARKED) -> list[Step]:
    """The page's marked blocks, in order."""
    return [Step(m["role"], m["name"] or "", m["command"] or "")
            for m in marked.finditer(text)]


def flag(command: str, name: str, default: str | None = None) -> str:
    """The value of ``--name VALUE`` in a command (the test fails if it is not there and
    there is no ``default``)."""
    found = re.search(rf"--{name} (\S+)", command)
    assert found or default is not None, f"--{name} not in {command!r}"
    return found[1] if found else str(default)


@dataclass(frozen=True)
class Plan:
    """What a page's commands set up, read from them: what the checks expect."""

    superlink_port: int
    tls: bool
    workdir: str  # the SuperLink's working folder, as written (under ~)
    connection: str  # the flwr CLI's connection the run goes to
    devices: dict[int, str]  # partition id -> declared preset
    device_ports: list[int]  # those given with --port
    rounds: int

    @classmethod
    def read(cls, steps: list[Step]) -> Plan:
        [superlink] = [s.command for s in steps if s.name == "superlink"]
        devices = [s.command for s in steps if s.name.startswith("device-")]
        [run] = [s.command for s in steps if s.command.startswith("flwr run")]
        workdir = re.search(r"\bcd (~/\S+)", superlink)
        assert workdir, "the SuperLink's block starts it in its folder (cd ~/...)"
        return cls(
            superlink_port=int(flag(superlink, "port")), tls="--insecure" not in superlink,
            workdir=workdir[1], connection=run.split()[3],
            devices={int(flag(c, "partition-id", "0")): flag(c, "profile") for c in devices},
            device_ports=[int(flag(c, "port")) for c in devices if "--port" in c],
            rounds=int(re.search(r"strategy\.num_rounds=(\d+)", run)[1]))

    def folder(self, home: Path) -> Path:
        return home / self.workdir.removeprefix("~/")


def test_the_how_to_marks_a_deployment_whose_parts_agree():
    """Without starting anything: the marked blocks are the page's steps, in order, and
    the numbers in them agree (keys made = keys registered = devices = clients)."""
    steps = doc_steps(HOW_TO.read_text())
    assert [(s.role, s.name) for s in steps] == [
        ("run", ""), ("background", "superlink"), ("run", ""), ("background", "device-0"),
        ("background", "device-1"), ("check", "supernodes"), ("run", ""),
        ("check", "run-folder")]
    plan = Plan.read(steps)
    nodes = int(flag(steps[0].command, "nodes"))
    registered = re.findall(r"flwr supernode register (\S+)", steps[2].command)
    assert nodes == len(registered) == len(plan.devices) == 2
    assert f"num_clients={nodes}" in steps[6].command
    assert plan.tls and len(set(plan.device_ports)) == len(plan.devices)  # each its own --port
    assert flag(steps[0].command, "superlink") == f"127.0.0.1:{plan.superlink_port}"
    for i, step in enumerate(s for s in steps if s.name.startswith("device-")):
        assert f"{plan.workdir}/node{i}.key " in step.command
        assert f"{plan.workdir}/node{i}.key.pub" in registered[i]


def test_the_tutorial_marks_one_device_without_tls():
    steps = doc_steps(TUTORIAL.read_text())
    assert [(s.role, s.name) for s in steps] == [
        ("background", "superlink"), ("run", ""), ("run", ""), ("background", "device-0"),
        ("check", "supernodes"), ("run", ""), ("check", "run-folder")]
    plan = Plan.read(steps)
    assert not plan.tls and plan.devices == {0: "raspberry_pi_4"}
    assert f'[superlink.{plan.connection}]' in steps[2].command


def shell(command: str, env: dict[str, str], *, timeout: float) -> subprocess.CompletedProcess:
    """Run a block as the reader would paste it: bash, in the project's folder."""
    return subprocess.run(["bash", "-eo", "pipefail", "-c", command], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def succeeded(command: str, env: dict[str, str], *, timeout: float = 120) -> str:
    """Run ``command`` to its end; return what it printed (the test fails if it failed)."""
    done = shell(command, env, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{command}\nexited {done.returncode}:\n{output[-4000:]}"
    return output


def port_taken(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def home_env(home: Path) -> dict[str, str]:
    """The reader's shell, in a home of its own: the venv's tools first on PATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLWR_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME")}
    return env | {
        "HOME": str(home), "PATH": os.pathsep.join([str(FLWR.parent), env.get("PATH", "")]),
        "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "WANDB_MODE": "disabled",
        "WANDB_DIR": str(home), "RAY_TMPDIR": str(home)}


def listing_online(command: str, env: dict[str, str], count: int) -> str:
    """Run the page's ``flwr supernode ls`` until it lists ``count`` nodes online; its output.

    A device is online a few seconds after it starts (its SuperNode's first heartbeat).
    """
    listing = [""]

    def online() -> bool:
        listing[0] = succeeded(command, env)
        return len(re.findall(r"\bonline\b", listing[0])) >= count

    wait_for(online, f"{count} devices online", timeout_s=120)
    return listing[0]


def wait_until_finished(connection: str, env: dict[str, str]) -> None:
    """Wait until the SuperLink records every run finished; fail unless all completed.

    ``flwr run --stream`` can return before its run has ended (tests/integration/
    test_flwr_run.py). Each ``flwr ls`` costs a second or two of CPU: every 3 s.
    """
    statuses: dict[str, str] = {}

    def finished() -> bool:
        listing = shell(f"flwr ls {connection} --format json", env, timeout=60)
        assert listing.returncode == 0, listing.stdout + listing.stderr
        statuses.update({r["run-id"]: r["status"] for r in json.loads(listing.stdout)["runs"]})
        done = all(s.startswith("finished") for s in statuses.values())
        time.sleep(0 if done else 3)
        return done

    wait_for(finished, "the run finished", timeout_s=180)
    assert set(statuses.values()) == {"finished:completed"}, statuses


def stop_everything(processes: Processes, home: Path) -> None:
    """Stop what the test started, then whatever those left behind (by the test's home)."""
    processes.stop_all()
    for pid in pids_in_environment("HOME", str(home)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def follow(page: Path, tmp_path: Path) -> tuple[Plan, Path, list[Step], dict[int, str]]:
    """Do what ``page`` says, block by block; return its plan, the SuperLink's working
    folder, its steps and what each step printed."""
    steps = doc_steps(page.read_text())
    plan = Plan.read(steps)
    taken = [p for p in (plan.superlink_port, *plan.device_ports) if port_taken(p)]
    if taken:
        pytest.fail(f"127.0.0.1 ports {taken} are in use (another SuperLink or SuperNode?): "
                    f"{page.name}'s commands need them; stop what holds them")
    home = tmp_path / "home"
    home.mkdir()
    env = home_env(home)
    workdir = plan.folder(home)
    ca = workdir / "ca.crt" if plan.tls else None
    processes = Processes(tmp_path)
    outputs: dict[int, str] = {}
    try:
        for i, step in enumerate(steps):
            if step.role == "background":
                processes.start(step.name, ["bash", "-c", step.command], env)
                if step.name == "superlink":
                    wait_for(lambda: superlink_answers(plan.superlink_port, ca=ca),
                             f"the SuperLink answers\n{processes.log('superlink')}")
            elif step.name == "supernodes":
                outputs[i] = listing_online(step.command, env, len(plan.devices))
            else:
                outputs[i] = succeeded(step.command, env, timeout=400)
                if step.command.startswith("flwr run"):
                    wait_until_finished(plan.connection, env)
    finally:
        stop_everything(processes, home)
    return plan, workdir, steps, outputs


def check_results(plan: Plan, workdir: Path, steps: list[Step], outputs: dict[int, str]
                  ) -> Path:
    """What the page tells the reader to look at; return the run folder."""
    [run_at] = [i for i, s in enumerate(steps) if s.command.startswith("flwr run")]
    printed = re.search(r"run folder: (\S+)", outputs[run_at])
    assert printed, outputs[run_at][-3000:]
    for n in range(1, plan.rounds + 1):  # the round lines the pages show
        assert re.search(rf"\[round +{n}/{plan.rounds}\] test acc", outputs[run_at])
    run_dir = Path(printed[1])
    # Printed absolute, in the SuperLink's working folder (where the pages say it lands).
    assert run_dir.is_absolute() and run_dir.parent.parent == workdir / "outputs" / "flwr"
    assert all((run_dir / name).is_file() for name in RUN_FILES), sorted(os.listdir(run_dir))
    with open(run_dir / "clients.csv") as f:
        rows = list(csv.DictReader(f))
    expected = sorted((str(r), str(p), plan.devices[p]) for r in range(1, plan.rounds + 1)
                      for p in plan.devices)
    assert sorted((r["round"], r["partition_id"], r["profile"]) for r in rows) == expected
    assert {r["status"] for r in rows} == {"ok"}, rows
    # The page's own check lists the folder and prints those rows: each preset, ok.
    [check_at] = [i for i, s in enumerate(steps) if s.name == "run-folder"]
    for name in RUN_FILES:
        assert name in outputs[check_at]
    for profile in plan.devices.values():
        assert outputs[check_at].count(f",ok,{profile},") == plan.rounds, outputs[check_at]
    # run.log has the ServerApp's lines and Flower's (one per round at least).
    log = (run_dir / "run.log").read_text()
    assert f"run folder: {run_dir}" in log
    assert len(re.findall(r"\[flwr\]\[INFO\] - \[ROUND \d+/", log)) >= plan.rounds, log[-3000:]
    return run_dir


@pytest.mark.serial
def test_the_deployment_how_to_runs_as_written_on_one_host(tmp_path):
    """Certificates, a TLS SuperLink with node authentication, 2 registered devices
    (``clients.connect``, each its own ``--port``), ``flwr run`` with the trunk on TLS, and
    the page's checks: both devices online, the run folder where the page says and printed,
    every ``clients.csv`` row ``ok`` with the preset its device declared; the private keys
    readable by their owner only."""
    plan, workdir, steps, outputs = follow(HOW_TO, tmp_path)
    run_dir = check_results(plan, workdir, steps, outputs)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["dataplane"]["ssl_certfile"] == "server.pem"  # read from the working folder
    for key in ("server.key", *(f"node{p}.key" for p in plan.devices)):
        assert (workdir / key).stat().st_mode & 0o777 == 0o600, key


@pytest.mark.serial
def test_the_connect_a_device_tutorial_runs_as_written(tmp_path):
    """A SuperLink without TLS, the CLI's connection added by hand, one device, two rounds:
    the device online, and its rows in the run folder ``ok`` with its preset."""
    check_results(*follow(TUTORIAL, tmp_path))


#: The phone tutorial's marks: as the deployment pages', and ``phones N`` (no block: the
#: reader opens the link on N phones and consents).
PHONE_MARKED = re.compile(r"<!-- phone-test: (?P<role>run|background|check|phones)"
                          r"(?: (?P<name>[\w-]+))? -->\n(?:```bash\n(?P<command>.*?)\n```)?",
                          re.S)


def join_url(log: Path) -> str | None:
    found = re.search(r"phones join at (\S+)", log.read_text())
    return found[1] if found else None


@pytest.mark.serial
def test_the_connect_a_phone_tutorial_runs_as_written(tmp_path):
    """Steps 1 and 2 of connect-a-device (a SuperLink, the CLI's connection), then the phone
    tutorial: the gateway on this host's network address, two Chromium pages at a phone's
    size opening the link it printed and consenting, ``flwr run`` with ``devices.web=true``,
    and the page's check: each phone's rows ``ok`` as a ``mid_range_phone``. The pages are
    photographed as the tutorial shows them (``tmp_path/consent.png``, ``training.png``)."""
    from playwright.sync_api import sync_playwright

    steps = (doc_steps(TUTORIAL.read_text())[:3]
             + doc_steps(PHONE_TUTORIAL.read_text(), PHONE_MARKED))
    assert [(s.role, s.name) for s in steps] == [
        ("background", "superlink"), ("run", ""), ("run", ""), ("background", "gateway"),
        ("phones", "2"), ("run", ""), ("check", "run-folder")]
    phones = int(steps[4].name)
    assert f"--phones {phones}" in steps[3].command
    rounds = int(re.search(r"strategy\.num_rounds=(\d+)", steps[5].command)[1])
    port = int(flag(steps[0].command, "port"))
    home = tmp_path / "home"
    home.mkdir()
    env = home_env(home)
    processes = Processes(tmp_path)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=shutil.which("chromium"),
                                     args=["--no-sandbox"])
        try:
            pages = []
            for step in steps:
                if step.role == "background":
                    processes.start(step.name, ["bash", "-c", step.command], env)
                    if step.name == "superlink":
                        wait_for(lambda: superlink_answers(port), "the SuperLink answers")
                    else:
                        log = tmp_path / f"{step.name}.log"
                        wait_for(lambda log=log: join_url(log), "the gateway's link")
                        assert (home / "splitlearn-tutorial" / "join.png").is_file()
                elif step.role == "phones":
                    pages = [open_phone(browser, join_url(log), tmp_path, i)
                             for i in range(phones)]
                elif step.role == "run":
                    run = subprocess.Popen(["bash", "-eo", "pipefail", "-c", step.command],
                                           cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True)
                    if "flwr run" in step.command:
                        photograph_training(pages[0], tmp_path)
                    output, _ = run.communicate(timeout=400)
                    assert run.returncode == 0, output[-3000:]
                    if "flwr run" in step.command:
                        wait_until_finished("tutorial", env)
                else:
                    shown = succeeded(step.command, env)
            for page in pages:
                assert page.inner_text("#round") == str(rounds)
        finally:
            browser.close()
            stop_everything(processes, home)
    assert shown.count(",ok,mid_range_phone,") == phones * rounds, shown


def open_phone(browser, url: str, tmp_path: Path, index: int):  # noqa: ANN001, ANN201
    """A phone's page: the link opened, consent given, connected."""
    page = browser.new_context(viewport={"width": 390, "height": 844}, device_scale_factor=2,
                               is_mobile=True, has_touch=True).new_page()
    page.goto(url)
    page.wait_for_function("document.getElementById('backend').textContent !== '-'")
    if index == 0:
        page.screenshot(path=str(tmp_path / "consent.png"))
    page.click("#join")
    wait_for(lambda: page.inner_text("#state").startswith("connected"), "a phone connected")
    return page


def batches_done(page) -> int:  # noqa: ANN001
    """The batches the page shows done in its round (0 before the first)."""
    found = re.match(r"(\d+) / ", page.inner_text("#batches"))
    return int(found[1]) if found else 0


def photograph_training(page, tmp_path: Path) -> None:  # noqa: ANN001
    """Photograph the page a few batches into the second round."""
    wait_for(lambda: page.inner_text("#round") == "2" and batches_done(page) >= 5,
             "round 2 under way", timeout_s=300)
    page.screenshot(path=str(tmp_path / "training.png"))
