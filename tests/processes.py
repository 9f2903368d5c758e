"""Waiting on, finding and asking the processes the integration tests start."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
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


#: What ``experiments.run`` logs once Ray has started: where Ray writes its own logs.
RAY_LOGS = re.compile(r"Ray's logs: (\S+)")


def run_or_report(args: Sequence[str], *, timeout_s: float, **popen: object
                  ) -> subprocess.CompletedProcess[str]:
    """Run ``args`` in a session of its own, as ``subprocess.run`` with captured text.

    A command still running after ``timeout_s`` fails the test with what it says about
    where it is stuck: every ``experiments.run`` in the session prints its threads'
    stacks (it dumps them on SIGUSR1), and the ends of the Ray logs it named (the
    ClientApps' workers, the raylet). Then the whole session is killed, Ray included,
    so nothing it started outlives the test.
    """
    proc = subprocess.Popen(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, **popen)  # type: ignore[call-overload]
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as stuck:
        for pid in session_pids(proc.pid):
            if "experiments.run" in _cmdline(pid):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(2.0)
        # Read Ray's logs while its workers still run (killed, they log their own exit).
        so_far = b"".join(part or b"" for part in (stuck.stdout, stuck.stderr))
        tails = ray_log_tails(so_far.decode(errors="replace"))
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"{' '.join(args)!r} did not finish in {timeout_s:.0f} s\n--- stdout\n"
            f"{stdout[-4000:]}\n--- stderr\n{stderr[-12000:]}{tails}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def session_pids(session: int) -> list[int]:
    """PIDs of the processes in ``session`` (a session leader's PID)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[3]) == session:  # pid (comm) state ppid pgrp session
                pids.append(int(proc.name))
    return pids


def ray_log_tails(printed: str, *, lines: int = 15) -> str:
    """The last ``lines`` of the raylet's and each worker's logs the output names."""
    tails = []
    for folder in dict.fromkeys(RAY_LOGS.findall(printed)):
        logs = Path(folder)
        for log in [logs / "raylet.out", *sorted(logs.glob("worker-*.err")),
                    *sorted(logs.glob("python-core-worker-*.log"))]:
            if log.is_file():
                tail = log.read_text(errors="replace").splitlines()[-lines:]
                tails.append(f"\n--- {log}\n" + "\n".join(tail))
    return "".join(tails)


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
