"""Waiting on, finding and asking the processes the integration tests start."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def wait_for(condition: Callable[[], bool], what: str, *, timeout_s: float = 60.0) -> None:
    """Poll ``condition`` every half second; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s} s"
        time.sleep(0.5)


def pids_mentioning(text: str) -> list[int]:
    """PIDs whose command line mentions ``text`` (a test's own folder).

    Flower detaches some of the processes it starts (the SuperLink's simulation and
    ServerApp, SuperExec); naming the test's folder is how a test finds what it caused.
    """
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                pids.append(int(proc.name))
    return pids


def superlink_answers(port: int, *, ca: Path | None = None) -> bool:
    """Whether a SuperLink on 127.0.0.1:``port`` answers ``/health``.

    Over TLS verified against ``ca`` when one is given, plain HTTP (``--insecure``) otherwise.
    """
    url = f"{'https' if ca else 'http'}://127.0.0.1:{port}/health"
    try:
        return httpx.get(url, verify=str(ca) if ca else True, timeout=2).is_success
    except httpx.HTTPError:
        return False


def pids_in_environment(name: str, value: str) -> list[int]:
    """PIDs (not this one) whose environment sets ``name`` to ``value``.

    A test that gives the processes it starts a home folder of their own finds by it every
    process they caused, detached ones included (Flower's SuperExec and its apps), whose
    command lines need not name anything of the test's.
    """
    wanted = f"{name}={value}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                environment = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if wanted in environment:
                pids.append(int(proc.name))
    return pids
