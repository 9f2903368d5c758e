"""Every command of the tutorials, run as written, so the docs cannot drift from the code.

Each tutorial of ``docs/tutorials/`` (but ``connect-a-device.md``, whose commands need a
SuperLink: the deployment test runs those steps) is read top to bottom:

* a ```` ```bash ```` block is run with ``bash -eo pipefail`` in the tutorial's own
  temporary folder (the reader's repository root: the project is installed, so nothing
  else of the checkout is needed there), unless the line before it is
  ``<!-- tutorial-test: skip (why) -->``;
* a ```` ```python title="FILE" ```` block is written to ``FILE`` there, as the reader
  saves it.

W&B, Hugging Face and Flower keep their files in that folder and never go online. After
the commands, the test checks what the tutorial tells the reader to look at: the run
folder's files it names, and the paths it names under ``outputs/``, ``multirun/`` and
``my_data/``. The three tutorials run at once, each in its own folder: their commands
mostly wait (on Ray's start-up and Flower's polls), so they overlap well on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest

from benchmarks.rounds import PARTS, clients_in_parallel, round_budget
from tests.integration.test_simulation import read_clients
from tests.processes import run_or_report

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "docs" / "tutorials"
#: The tutorials this test runs (``connect-a-device.md`` needs a SuperLink and devices).
RUN = ("first-run.md", "compare-protocols.md", "your-model-and-data.md")
SKIP = re.compile(r"<!--\s*tutorial-test:\s*skip\b")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)(?P<attrs>[^\n]*)\n(?P<body>.*?)^```\s*$",
                   re.MULTILINE | re.DOTALL)
#: Files of a run folder a tutorial may name.
RUN_FILE = re.compile(r"`([\w-]+\.(?:json|csv|png|pt|log)|wandb/)`")
#: Paths a tutorial names under the folders its commands write.
WRITTEN_PATH = re.compile(r"`((?:outputs|multirun|my_data)/[\w./-]+)`")

pytestmark = pytest.mark.serial  # Flower's Simulation Engine, on both cores


@dataclass(frozen=True)
class Step:
    """One thing a tutorial asks the reader to do: run a command, or save a file."""

    kind: str  # "bash" or "file"
    text: str
    path: str = ""  # the file's name, for "file"


def tutorial_steps(markdown: str) -> list[Step]:
    """Return a tutorial's steps in order: its bash blocks and its titled Python files."""
    steps = []
    for block in FENCE.finditer(markdown):
        before = markdown[:block.start()].rstrip().splitlines()
        if before and SKIP.search(before[-1]):
            continue
        title = re.search(r'title="([^"]+)"', block["attrs"])
        if block["lang"] == "bash":
            steps.append(Step("bash", block["body"]))
        elif block["lang"] == "python" and title:
            steps.append(Step("file", block["body"], title.group(1)))
    return steps


def sandbox_env(folder: Path) -> dict[str, str]:
    """The reader's shell, with every tool's files in ``folder`` and nothing online."""
    return os.environ | {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_HOME": str(folder / ".flwr"),
        "WANDB_API_KEY": "",
        "WANDB_MODE": "offline",
        "WANDB_CACHE_DIR": str(folder / ".wandb-cache"),
        "WANDB_CONFIG_DIR": str(folder / ".wandb-config"),
        "WANDB_DATA_DIR": str(folder / ".wandb-data"),
        "HF_HOME": str(folder / ".hf"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "MPLCONFIGDIR": str(folder / ".matplotlib"),
    }


def run_steps(steps: list[Step], folder: Path) -> str:
    """Run ``steps`` in ``folder``; return everything the commands printed."""
    env = sandbox_env(folder)
    printed = []
    for step in steps:
        if step.kind == "file":
            (folder / step.path).write_text(step.text)
            continue
        proc = run_or_report(["bash", "-eo", "pipefail", "-c", step.text], cwd=folder, env=env,
                             timeout_s=560)
        printed.append(proc.stdout + proc.stderr)
        assert proc.returncode == 0, (
            f"tutorial command failed ({proc.returncode}):\n{step.text}\n"
            f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}")
    return "\n".join(printed)


@dataclass
class Ran:
    """A tutorial run in its folder: what its commands printed, or how they failed."""

    folder: Path
    printed: str = ""
    error: BaseException | None = None


def run_tutorial(name: str, folder: Path) -> Ran:
    """Run one tutorial's steps in ``folder``, keeping a failure for its own test."""
    folder.mkdir()
    try:
        return Ran(folder, run_steps(tutorial_steps((TUTORIALS / name).read_text()), folder))
    except BaseException as error:  # noqa: BLE001 - re-raised by the tutorial's test
        return Ran(folder, error=error)


@pytest.fixture(scope="module")
def tutorials(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    """Every tutorial of :data:`RUN`, run at once, each in a folder of its own."""
    root = tmp_path_factory.mktemp("tutorials")
    with ThreadPoolExecutor(len(RUN)) as pool:
        runs = {name: pool.submit(run_tutorial, name, root / Path(name).stem) for name in RUN}
        return {name: run.result() for name, run in runs.items()}


def ran(tutorials: dict[str, Ran], name: str) -> tuple[str, Path, str]:
    """Return a tutorial's markdown, folder and output; raise what failed in it."""
    result = tutorials[name]
    if result.error is not None:
        raise result.error
    return (TUTORIALS / name).read_text(), result.folder, result.printed


def latest_run(folder: Path) -> Path:
    runs = sorted(p for p in folder.glob("outputs/*/*") if p.is_dir())
    assert runs, "no run folder under outputs/"
    return runs[-1]


def check_named_paths(markdown: str, folder: Path) -> None:
    """Every path the tutorial names under the folders its commands write exists."""
    for name in WRITTEN_PATH.findall(markdown):
        if "DATE" not in name and "*" not in name:
            assert (folder / name).exists(), f"the tutorial names {name}, which is not there"


def test_first_run(tutorials):
    markdown, tmp_path, printed = ran(tutorials, "first-run.md")
    run = latest_run(tmp_path)
    assert f"run folder: {run}" in printed
    assert "[round   3/3]" in printed
    named = set(RUN_FILE.findall(markdown))
    assert {"config.json", "metrics.json", "clients.csv", "model.pt", "wandb/"} <= named
    for name in named:
        assert (run / name).exists(), f"the tutorial names {name}, not in {sorted(run.iterdir())}"
    assert list((run / "wandb").glob("offline-run-*")), "W&B ran online, or not at all"
    assert "round 3: test accuracy" in printed
    assert re.search(r"^3 \d+ ok 1 \d+$", printed, re.MULTILINE)  # the last round's devices
    assert "torch.Size([1, 10])" in printed  # the model loaded into the network
    check_named_paths(markdown, tmp_path)
    check_complete_run_folder(run, printed)


def check_complete_run_folder(run: Path, printed: str) -> None:
    """The default job's run folder holds everything a person reads, and it adds up."""
    config = json.loads((run / "config.json").read_text())
    rounds = json.loads((run / "metrics.json").read_text())
    assert [r["round"] for r in rounds] == list(range(config["strategy"]["num_rounds"] + 1))
    # The run's elapsed time (progress lines, ETA) grows, whatever the clients report.
    assert all(0 < a["wall_s"] < b["wall_s"] for a, b in pairwise(rounds))
    assert rounds[-1]["test_accuracy"] > rounds[0]["test_accuracy"] + 0.2  # it learned
    for r in rounds[1:]:
        # Every digits training sample, once per local epoch.
        assert r["examples"] == 1437 * config["strategy"]["local_epochs"]
        assert r["bytes_up"] > 0 and r["bytes_down"] > 0 and r["failed_clients"] == 0
    rows = read_clients(run)
    assert len(rows) == config["num_clients"] * config["strategy"]["num_rounds"]
    assert {row["status"] for row in rows} == {"ok"}
    # Where each client's handler spent its time: set-up, then training, within the handler.
    for row in rows:
        setup, train, handler = (float(row[k]) for k in ("setup_s", "train_s", "handler_s"))
        assert 0 < setup and 0 < train and setup + train <= handler
    parallel = clients_in_parallel([f"num_clients={config['num_clients']}"])
    budget = round_budget(rounds, rows, parallel=parallel)
    assert sum(budget[key] for key, _ in PARTS) == pytest.approx(budget["round_s"])
    assert 0 < budget["evaluate_s"] < budget["round_s"]
    assert (run / "metrics.csv").read_text().startswith("round,")
    for png in ("metrics.png", "clients.png"):
        assert (run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    offline = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0
    # What the reader saw: devices that ended their streams cleanly (no "ended abruptly",
    # the trunk's word for a device that vanished), and no start-up chatter of Ray's
    # or of alembic's (Flower's link state imports it).
    for noise in ("ended abruptly", "alembic", "Tip: In future versions of Ray"):
        assert noise not in printed, noise


def test_compare_protocols(tutorials):
    markdown, tmp_path, printed = ran(tutorials, "compare-protocols.md")
    table = (tmp_path / "multirun" / "compare" / "comparison.md").read_text()
    assert "| fedavg |" in table and "| splitfed_v2 |" in table
    assert table in printed  # compare printed what it wrote
    for run in ("0", "1"):
        assert (tmp_path / "multirun" / "compare" / run / "clients.csv").exists()
    assert "run 0: devices [" in printed and "run 1: devices [" in printed
    check_named_paths(markdown, tmp_path)


def test_your_model_and_data(tutorials):
    markdown, tmp_path, printed = ran(tutorials, "your-model-and-data.md")
    assert "model.cut=3: after features.2, sends (8, 4, 4) (512 bytes per example)" in printed
    assert "{'train': 1437, 'test': 360}" in printed
    run = latest_run(tmp_path)
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["_target_"] == "mynets.TinyNet"
    assert config["dataset"] == config["dataset"] | {"name": "mnist", "path": "my_data"}
    assert "'features.0.weight'" in printed  # the state dict in the user's own names
    check_named_paths(markdown, tmp_path)
