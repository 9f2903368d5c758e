"""The docs site builds with ``--strict``, and its generated reference covers the code.

``mkdocs build --strict`` fails on a broken link or anchor, a page missing from the nav, a
snippet that is not there and a docstring mkdocstrings cannot read. The generated
configuration reference is checked against the dataclasses as Python sees them (the docs
hook reads the source with ``ast``), and the run-folder reference against the statuses the
strategy records.
"""

from __future__ import annotations

import dataclasses
import html
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from protocols import PROTOCOLS
from splitlearn.config import Config, StrategyConfig
from splitlearn.dataplane import trunk_pb2 as pb
from strategies.reporting import STATUSES
from tests.integration.test_tutorials import FENCE, RUN, SKIP, TUTORIALS, tutorial_steps

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built as ``make docs`` builds it."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=os.environ | {"NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


def config_keys(schema: type, prefix: str = "") -> list[str]:
    """Every key a dataclass schema accepts, as the reference names them."""
    keys = []
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        kind = hints[field.name]
        key = f"{prefix}{field.name}"
        args = typing.get_args(kind)
        if kind is StrategyConfig:
            continue  # below, with every protocol's options
        if dataclasses.is_dataclass(kind):
            keys += config_keys(kind, f"{key}.")
        elif args and dataclasses.is_dataclass(args[-1]):
            holder = ".<name>" if typing.get_origin(kind) is dict else "[i]"
            keys += [f"{key}{holder}", *config_keys(args[-1], f"{key}{holder}.")]
        else:
            keys.append(key)
    return keys


def test_the_site_builds_strictly_and_the_config_reference_has_every_key(site):
    page = html.unescape((site / "reference" / "config" / "index.html").read_text())
    keys = config_keys(Config) + config_keys(StrategyConfig, "strategy.")
    keys += [f"strategy.{f.name}" for p in PROTOCOLS.values()
             for f in dataclasses.fields(p.options)]
    missing = [key for key in keys if f"<code>{key}</code>" not in page]
    assert not missing, f"keys missing from the configuration reference: {missing}"
    assert "<code>strategy=sglr</code>" in page and "<code>+scenario=NAME</code>" in page


def test_the_cli_reference_and_the_protocol_table_are_filled(site):
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "<!-- cli:" not in cli and "--superlink" in cli and "--quick" in cli
    protocols = (site / "explanation" / "protocols" / "index.html").read_text()
    for name in PROTOCOLS:
        assert f"<code>{name}</code>" in protocols
    proto = (site / "reference" / "trunk-proto" / "index.html").read_text()
    assert "STALE_FEEDBACK" in proto and "--8&lt;--" not in proto  # the .proto is embedded
    threats = (site / "explanation" / "threat-model" / "index.html").read_text()
    reasons = [r for r in pb.Refusal.Reason.keys() if r != "REASON_UNSPECIFIED"]
    assert not [r for r in reasons if f"<code>{r}</code>" not in threats]


def test_links_into_the_api_reference_land_on_an_object(site):
    # MkDocs checks anchors of headings it wrote; the API page's are mkdocstrings'.
    api = (site / "reference" / "api" / "index.html").read_text()
    anchors = {a for page in (ROOT / "docs").rglob("*.md")
               for a in re.findall(r"api\.md#([\w.]+)", page.read_text())}
    assert anchors and not [a for a in anchors if f'id="{a}"' not in api]


def test_the_run_folder_reference_names_every_status():
    page = (ROOT / "docs" / "reference" / "run-folder.md").read_text()
    assert not [s for s in STATUSES if f"| `{s}` |" not in page]


def test_the_tutorials_blocks_parse():
    # Each tutorial has commands, and a skipped block is only ever the one after the marker.
    for name in RUN:
        markdown = (TUTORIALS / name).read_text()
        steps = tutorial_steps(markdown)
        assert any(s.kind == "bash" for s in steps), name
        skipped = len(SKIP.findall(markdown))
        blocks = sum(1 for b in FENCE.finditer(markdown) if b["lang"] == "bash")
        assert len([s for s in steps if s.kind == "bash"]) == blocks - skipped, name
