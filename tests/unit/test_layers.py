"""The layers hold: protocols are asked, never named, and a device loads no server code.

``lint-imports`` (in the test command) checks the static imports between the packages;
these check what it cannot see: string constants naming a protocol or attribute reads
of one protocol's options outside that protocol's own files, and the modules a
device's process really loads (the registry resolves parts by import path).
"""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from protocols import PROTOCOLS, Protocol
from splitlearn.config import StrategyConfig

ROOT = Path(__file__).resolve().parents[2]
#: The project's code; tests and the benchmarks (which choose protocols to measure, as a
#: command line does) are not asked to stay protocol-blind.
PACKAGES = ("clients", "server", "strategies", "protocols", "splitlearn", "experiments")
REGISTRY = ROOT / "protocols" / "registry.py"


def own_files(protocol: Protocol) -> set[Path]:
    """The files of a protocol's declaration and of each of its parts."""
    parts = [protocol.options, protocol.client, protocol.strategy, protocol.trunk]
    return {Path(inspect.getfile(inspect.getmodule(p))).resolve() for p in parts if p}


def option_fields(protocol: Protocol) -> set[str]:
    shared = {f.name for f in fields(StrategyConfig)}
    return {f.name for f in fields(protocol.options)} - shared


def python_files() -> list[Path]:
    return sorted(p.resolve() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def protocol_mentions(path: Path) -> list[tuple[int, str, str]]:
    """(line, protocol, how) of every constant naming a protocol or read of its options."""
    names = {p.name: p.name for p in PROTOCOLS.values()}
    options = {field: " ".join(sorted(p.name for p in PROTOCOLS.values()
                                      if field in option_fields(p)))
               for protocol in PROTOCOLS.values() for field in option_fields(protocol)}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and node.value in names:
            found.append((node.lineno, names[node.value], f"names {node.value!r}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in options):
            found.append((node.lineno, options[node.args[1].value],
                          f"{node.func.id}(..., {node.args[1].value!r})"))
        elif isinstance(node, ast.Attribute) and node.attr in options:
            found.append((node.lineno, options[node.attr], f"reads .{node.attr}"))
    return sorted(found)


def test_no_module_outside_a_protocols_files_names_it_or_reads_its_options():
    owners = {name: own_files(p) | {REGISTRY} for name, p in PROTOCOLS.items()}
    shared_options = {f for p in PROTOCOLS.values() for f in option_fields(p)}
    assert shared_options >= {"tail_cut", "bulk"}  # the scan knows the options it looks for
    stray = [f"{path.relative_to(ROOT)}:{line}: {how} ({names})"
             for path in python_files() for line, names, how in protocol_mentions(path)
             if not any(path in owners[name] for name in names.split())]
    assert not stray, "ask the registry (capabilities) instead:\n" + "\n".join(stray)


def test_the_scan_finds_a_name_a_getattr_and_an_option_read(tmp_path):
    # The scan above must be able to fail: each way of asking by name is found.
    planted = tmp_path / "planted.py"
    planted.write_text("def f(cfg):\n"
                       "    if cfg.strategy.name == 'ushaped':\n"
                       "        return getattr(cfg.strategy, 'bulk', False)\n"
                       "    return cfg.strategy.tail_cut\n")
    assert [how for _, _, how in protocol_mentions(planted)] == [
        "names 'ushaped'", "getattr(..., 'bulk')", "reads .tail_cut"]


def test_every_part_of_every_protocol_resolves_to_what_its_layer_provides():
    from clients.steps.base import ClientStep
    from strategies.reporting import ReportingFedAvg
    from strategies.splitfed import SplitFed

    for name, protocol in PROTOCOLS.items():
        assert issubclass(protocol.client, ClientStep), name
        assert issubclass(protocol.strategy, ReportingFedAvg), name
        has_trunk = protocol.capabilities.trunk != "none"
        assert issubclass(protocol.strategy, SplitFed) == has_trunk, name
        assert protocol.client.needs_channel == has_trunk, name
        assert (protocol.trunk is not None) == has_trunk, name
        assert protocol.trunk is None or callable(protocol.trunk), name


def test_a_part_that_does_not_exist_is_named_in_the_error():
    from protocols.spec import load_part

    with pytest.raises(ValueError, match="clients.steps.split:NoSuchStep"):
        load_part("clients.steps.split:NoSuchStep")


DEVICE_PROCESS = """
import json, sys, time
start = time.perf_counter()
import clients.app, clients.connect
imported_s = time.perf_counter() - start
from protocols import PROTOCOLS
from clients.steps.executorch import client_step_type
from splitlearn.config import RunSpec
for protocol in PROTOCOLS.values():  # every device step the ClientApp may build
    client_step_type(protocol, RunSpec(), recompute=False)
project = ("clients", "server", "strategies", "protocols", "splitlearn", "experiments")
print(json.dumps({"imported_s": imported_s, "modules": sorted(
    m for m in sys.modules if m.split(".")[0] in project)}))
"""


def test_a_devices_process_loads_no_server_or_strategy_module():
    out = subprocess.run([sys.executable, "-c", DEVICE_PROCESS], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    loaded = json.loads(out.splitlines()[-1])["modules"]
    assert "clients.steps.ushaped" in loaded and "clients.connect" in loaded  # it did load
    assert [m for m in loaded if m.split(".")[0] in ("server", "strategies", "experiments")] == []
