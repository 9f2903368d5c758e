"""Trunk workers: SplitFed v2's shared trunk sharded over processes, merged every round.

One trunk steps one batch at a time in one process, so SplitFed v2 cannot use more
than about one core of the server however many clients train. With
``dataplane.trunk_workers=W`` (W > 1) the ServerApp starts W worker processes, each
serving the data plane with its own copy of the trunk and optimiser. Each round's
clients are dealt to the workers in turn as their tokens are issued (in node order,
from the first worker each round, so a run's merges add the same copies in the same
order whatever order Flower drew the nodes in); within a
worker the trunk is shared and steps per batch (SplitFed v2), and at round end the
worker copies are merged stage by stage and weighted by samples, with the clients'
copies, as SplitFed v1 merges its per-client copies (:mod:`splitlearn.merge`).
Momentum is merged the same way, so a worker's optimiser carries on from the
merged direction. The ServerApp's own trunk holds the merged model (evaluation,
checkpoints, resume) and is copied to the workers before the next sessions start.

With one client per worker and no momentum a round is exactly SplitFed v1's; with
one worker it would be SplitFed v2's (that case runs in the ServerApp's process).

Each worker's trunk has its own guard (:mod:`server.guard`). Every round the ServerApp
seeds each with the reference rows it seeds its own with (:meth:`TrunkWorkers.seed_guards`),
so their bounds hold from the round's first frame too, and adds their counts of refused
frames, clipped steps and quarantined devices to the round's metrics
(:meth:`TrunkWorkers.take_guard_books`). A device is quarantined by the worker it was
dealt to, for the round (each round deals it to one).

With error feedback (``dataplane.compression.error_feedback``) each worker keeps the
memory of the clients it served; a client dealt to another worker in a later round (the
round's clients differ) has its memory moved there first, so it carries on where it was.

A worker is driven over a pipe: each command is answered before the next is sent,
and tensors travel as ``torch.save`` bytes (torch's own pickling of tensors through
a pipe would move them through shared memory the sender must keep alive).
"""

from __future__ import annotations

import io
import itertools
import logging
import multiprocessing as mp
import ssl
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import torch
from torch import Tensor

from server.allocator import reuse_freed_memory
from server.standalone import build_trunk_side
from server.trunk import Trunk
from splitlearn.config import (
    DataPlaneConfig,
    DatasetConfig,
    ModelConfig,
    ServerConfig,
    StrategyConfig,
)
from splitlearn.dataplane import TokenRegistry, TrunkEndpoint, TrunkService
from splitlearn.dataplane.feedback import FeedbackBook
from splitlearn.dataplane.tokens import SessionGrant
from splitlearn.merge import StageCopy, client_copy, client_stages, merge_stages, trunk_copy

log = logging.getLogger(__name__)

#: Longest a worker may take to import, build its trunk and start serving.
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TrunkRecipe:
    """Everything needed to build a protocol's trunk and its session handler (picklable).

    Parameters
    ----------
    protocol : str
        Registered protocol name (``strategy.name``).
    model, dataset : ModelConfig, DatasetConfig
        The network and the inputs it is built for.
    seed : int
        Seed of the model's initial weights (every copy starts from the same).
    options : StrategyConfig
        The protocol's options (learning rate, momentum, batching).
    dataplane : DataPlaneConfig
        What the data plane accepts, and where it serves.
    server : ServerConfig
        Where the trunk computes, and in what precision.
    """

    protocol: str
    model: ModelConfig
    dataset: DatasetConfig
    seed: int
    options: StrategyConfig
    dataplane: DataPlaneConfig
    server: ServerConfig = field(default_factory=ServerConfig)

    @property
    def sticky_core(self) -> bool:
        """Whether the trunk starts each step on the core the last one ended on."""
        if self.dataplane.trunk_sticky_core is not None:
            return self.dataplane.trunk_sticky_core
        return self.dataplane.trunk_workers == 1

    def build(self) -> tuple[Trunk, Any, TokenRegistry, TrunkEndpoint]:
        """Build the seeded trunk, the protocol's session handler (or None) and the endpoint."""
        from splitlearn.models.factory import build_model_from_config

        model = build_model_from_config(self.model, self.dataset, seed=self.seed)
        side = build_trunk_side(model, self.options, self.dataplane, sticky_core=self.sticky_core,
                                server=self.server)
        return side.trunk, side.handler, side.tokens, side.endpoint

    def for_worker(self, index: int) -> TrunkRecipe:
        """Return the recipe of trunk worker ``index``: on its own GPU where there are several.

        ``server.device`` ``cuda`` or ``auto`` puts worker ``i`` on ``cuda:(i mod N)`` when
        this machine has N > 1 CUDA devices; a named device (``cuda:1``) holds every worker.
        """
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if self.server.device not in ("cuda", "auto") or count < 2:
            return self
        return replace(self, server=replace(self.server, device=f"cuda:{index % count}"))


def server_credentials(dataplane: DataPlaneConfig) -> grpc.ServerCredentials | None:
    """TLS credentials of a trunk service from ``dataplane.ssl_*``, or None (plaintext)."""
    if dataplane.ssl_certfile is None:
        return None
    assert dataplane.ssl_keyfile is not None  # DataPlaneConfig checks they go together
    key = Path(dataplane.ssl_keyfile).read_bytes()
    chain = Path(dataplane.ssl_certfile).read_bytes()
    return grpc.ssl_server_credentials([(key, chain)])


def server_ssl_context(dataplane: DataPlaneConfig) -> ssl.SSLContext | None:
    """TLS of the trunk's WebSocket service from the same ``dataplane.ssl_*``, or None."""
    if dataplane.ssl_certfile is None:
        return None
    assert dataplane.ssl_keyfile is not None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(dataplane.ssl_certfile, dataplane.ssl_keyfile)
    return context


def pack(value: Any) -> bytes:
    """Serialise tensors (and what holds them) for the pipe."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    """Inverse of :func:`pack`."""
    return torch.load(io.BytesIO(data), weights_only=True)


class WorkerCommands:
    """What a worker process does on the ServerApp's commands (its trunk and its tokens)."""

    def __init__(self, trunk: Trunk, tokens: TokenRegistry, endpoint: TrunkEndpoint,
                 feedback: FeedbackBook | None = None) -> None:
        self.trunk = trunk
        self.tokens = tokens
        self.endpoint = endpoint
        self.feedback = feedback

    def grant(self, token: str, grant: SessionGrant) -> None:
        """Accept a token the ServerApp issued for a client dealt to this worker."""
        self.tokens.adopt(token, grant)

    def revoke(self, tokens: list[str]) -> None:
        """Invalidate tokens (their streams close)."""
        self.tokens.revoke(tokens)

    def pull(self) -> bytes:
        """Return this worker's stages, momentum and books since the last pull."""
        return pack({"stages": self.trunk.stage_state(),
                     "optimizer": self.trunk.optimizer_state(),
                     "books": self.trunk.take_books()})

    def push(self, data: bytes) -> None:
        """Replace the trunk's weights and optimiser state by the ServerApp's."""
        state = unpack(data)
        self.trunk.load_stages(state["stages"])
        self.trunk.load_optimizer_state(state["optimizer"])
        self.trunk.set_lr_factor(state["lr_factor"])

    def take_feedback(self, client: str) -> bytes | None:
        """Release ``client``'s error-feedback memory (None if this worker holds none)."""
        assert self.feedback is not None
        state = self.feedback.release(client)
        return None if state is None else pack(state)

    def give_feedback(self, client: str, data: bytes) -> None:
        """Hold ``client``'s error-feedback memory, released by another worker."""
        assert self.feedback is not None
        self.feedback.adopt(client, unpack(data))

    def refusals(self) -> dict[str, int]:
        """Frames this worker's endpoint refused, by reason."""
        return dict(self.endpoint.refusals)

    def seed_guard(self, data: bytes) -> None:
        """Seed the trunk's guard with the ServerApp's reference rows (none: no guard)."""
        if self.trunk.guard is not None:
            self.trunk.guard.seed_all(unpack(data))

    def guard_books(self) -> dict[str, int]:
        """Return the guard's counts since the last call and reset them (none: no guard)."""
        return {} if self.trunk.guard is None else self.trunk.guard.take_books()


def set_up_trunk_process(dataplane: DataPlaneConfig) -> None:
    """Set up a process that steps a trunk: its intra-op threads and its allocator."""
    torch.set_num_threads(dataplane.trunk_threads)
    if dataplane.trunk_reuses_memory:
        reuse_freed_memory()


def serve_worker(recipe: TrunkRecipe, port: int, conn: Connection) -> None:
    """Run a worker process: serve the data plane, answer commands until told to stop.

    The first message sent is the service's address. The worker also stops when the
    pipe closes (the ServerApp's process died), so no worker outlives its run.
    """
    set_up_trunk_process(recipe.dataplane)
    trunk, handler, tokens, endpoint = recipe.build()
    dataplane = recipe.dataplane
    service = TrunkService(endpoint, host=dataplane.host, port=port,
                           advertise_host=dataplane.advertise_host,
                           max_streams=dataplane.max_streams,
                           server_credentials=server_credentials(dataplane))
    service.start()
    commands = WorkerCommands(trunk, tokens, endpoint, getattr(handler, "feedback", None))
    conn.send(service.address)
    try:
        while True:
            try:
                name, args = conn.recv()
            except EOFError:
                break
            if name == "stop":
                conn.send((True, None))
                break
            try:
                conn.send((True, getattr(commands, name)(*args)))
            except Exception as err:  # noqa: BLE001 - reported to the ServerApp, not lost
                conn.send((False, f"{type(err).__name__}: {err}"))
    finally:
        service.stop()


class WorkerError(RuntimeError):
    """A trunk worker died or failed a command."""


class TrunkWorker:
    """The ServerApp's handle on one worker process."""

    def __init__(self, index: int, process: mp.process.BaseProcess, conn: Connection) -> None:
        self.index = index
        self.process = process
        self._conn = conn
        self._lock = threading.Lock()
        self.address = ""

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for the worker's address (it has built its trunk and is serving)."""
        if not self._conn.poll(timeout_s):
            raise WorkerError(f"trunk worker {self.index} did not start within {timeout_s:.0f} s")
        try:
            self.address = self._conn.recv()
        except EOFError:
            raise WorkerError(f"trunk worker {self.index} exited while starting "
                              f"(exit code {self.process.exitcode})") from None

    def call(self, name: str, *args: Any) -> Any:
        """Run a command in the worker and return its result (WorkerError if it failed)."""
        with self._lock:
            try:
                self._conn.send((name, args))
                ok, value = self._conn.recv()
            except (EOFError, BrokenPipeError, ConnectionResetError) as err:
                raise WorkerError(f"trunk worker {self.index} (pid {self.process.pid}) is gone "
                                  f"(exit code {self.process.exitcode})") from err
        if not ok:
            raise WorkerError(f"trunk worker {self.index}: {name} failed: {value}")
        return value

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the worker to stop; terminate it if it does not."""
        if self.process.is_alive():
            try:
                self.call("stop")
            except WorkerError:
                pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout_s)
        self._conn.close()


class TrunkWorkers:
    """SplitFed v2 over several trunk processes: the strategy's trunk side and token router.

    Parameters
    ----------
    trunk : Trunk
        The ServerApp's trunk: it holds the merged model between rounds and the
        books of every worker's steps (their busy time as the slowest worker's).
    tokens : TokenRegistry
        The ServerApp's registry; its revocations are forwarded to the workers.
    recipe : TrunkRecipe
        How each worker builds its copy.
    workers : int
        Number of worker processes (at least 2).
    """

    def __init__(self, trunk: Trunk, tokens: TokenRegistry, recipe: TrunkRecipe, *,
                 workers: int) -> None:
        if workers < 2:
            raise ValueError(f"trunk workers: need at least 2, got {workers}")
        self.trunk = trunk
        self.tokens = tokens
        self._workers = self._start(recipe, workers)
        self._deal = itertools.cycle(self._workers)
        self._dealing_round: int | None = None
        self._held: dict[str, TrunkWorker] = {}  # token -> the worker that holds it
        self._held_lock = threading.Lock()
        self._stale = True  # the workers' copies differ from the ServerApp's trunk
        #: With error feedback: the worker holding each client's memory (it served it last).
        self._feedback_at: dict[str, TrunkWorker] | None = (
            {} if recipe.dataplane.compression.error_feedback else None)
        tokens.on_revoke(self._forward_revocations)

    @staticmethod
    def _start(recipe: TrunkRecipe, count: int) -> list[TrunkWorker]:
        # spawn: a fork would copy the ServerApp's gRPC and Ray threads' locks mid-use.
        context = mp.get_context("spawn")
        workers = []
        for index in range(count):
            parent, child = context.Pipe()
            port = recipe.dataplane.port + index if recipe.dataplane.port else 0
            process = context.Process(target=serve_worker,
                                      args=(recipe.for_worker(index), port, child),
                                      name=f"trunk-worker-{index}", daemon=True)
            process.start()
            child.close()
            workers.append(TrunkWorker(index, process, parent))
        try:
            for worker in workers:
                worker.wait_ready(START_TIMEOUT_S)
        except WorkerError:
            for worker in workers:
                worker.stop()
            raise
        log.info("trunk workers serving at %s (pids %s)", ", ".join(w.address for w in workers),
                 ", ".join(str(w.process.pid) for w in workers))
        return workers

    @property
    def addresses(self) -> list[str]:
        """``host:port`` of each worker's trunk service."""
        return [w.address for w in self._workers]

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers."""
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    def route(self, token: str) -> str:
        """Deal the client holding ``token`` to the next worker; return that worker's address.

        The workers first receive the ServerApp's current trunk if it changed since
        they last did (a merged round, a resumed checkpoint).
        """
        grant = self.tokens.lookup(token)
        if grant is None:
            raise ValueError("route: the token is unknown, expired or revoked")
        self._sync()
        if grant.server_round != self._dealing_round:  # a new round: deal from the first
            self._deal = itertools.cycle(self._workers)
            self._dealing_round = grant.server_round
        worker = next(self._deal)
        self._move_feedback(grant.client, to=worker)
        worker.call("grant", token, grant)
        with self._held_lock:
            self._held[token] = worker
        return worker.address

    def _move_feedback(self, client: str, *, to: TrunkWorker) -> None:
        """Move ``client``'s error-feedback memory to the worker it is dealt to now."""
        if self._feedback_at is None:
            return
        held_by = self._feedback_at.get(client)
        self._feedback_at[client] = to
        if held_by is None or held_by is to:
            return
        data = held_by.call("take_feedback", client)
        if data is not None:  # else dropped there to stay within the budget
            to.call("give_feedback", client, data)

    def set_lr_factor(self, factor: float) -> None:
        """Train at the schedule's ``factor`` (the workers take it before their sessions)."""
        if factor != self.trunk.lr_factor:
            self.trunk.set_lr_factor(factor)
            self._stale = True

    def _sync(self) -> None:
        if not self._stale:
            return
        state = pack({"stages": self.trunk.stage_state(),
                      "optimizer": self.trunk.optimizer_state(), "lr_factor": self.trunk.lr_factor})
        for worker in self._workers:
            worker.call("push", state)
        self._stale = False

    def _forward_revocations(self, tokens: list[str]) -> None:
        by_worker: dict[int, list[str]] = {}
        with self._held_lock:
            for token in tokens:
                if (worker := self._held.pop(token, None)) is not None:
                    by_worker.setdefault(worker.index, []).append(token)
        for index, held in by_worker.items():
            self._workers[index].call("revoke", held)

    def finish_round(self, finished: Iterable[str]) -> None:
        """Nothing to settle here: the merge pulls every worker's copy."""

    def merge_round(
        self, updates: Sequence[tuple[Mapping[str, Tensor], int]], *, upto: int
    ) -> dict[str, Tensor]:
        """Merge the clients' copies with every worker's trunk copy, stage by stage.

        The merged stages and momentum become the ServerApp's trunk (and the workers'
        before their next sessions). Returns the clients' stages, as SplitFed v2's
        merge does.
        """
        clients = [client_copy(s, n) for s, n in updates]
        pulled = [unpack(w.call("pull")) for w in self._workers]
        trained = [p for p in pulled if p["books"]["samples"] > 0]
        copies = [trunk_copy(p["stages"], p["books"]["stage_samples"]) for p in trained]
        merged = merge_stages([*clients, *copies])
        current = self.trunk.stage_state()
        self.trunk.load_stages(merged)
        self.trunk.load_optimizer_state(merge_stages([
            StageCopy(p["optimizer"], c.stage_samples) for p, c in zip(trained, copies, strict=True)
        ]))
        self.trunk.add_books(
            steps=sum(p["books"]["steps"] for p in trained),
            samples=sum(p["books"]["samples"] for p in trained),
            # The workers step at the same time: the round waits for the slowest.
            busy_s=max((p["books"]["busy_s"] for p in trained), default=0.0),
        )
        self._stale = True
        return client_stages(merged, current, clients, upto=upto)

    def seed_guards(self, rows: Mapping[tuple[str, int], Tensor]) -> None:
        """Seed every worker's guard with this round's reference rows.

        Each worker's guard would otherwise calibrate from the rows its own devices send
        first, a warm-up a device striking first could shape (see :mod:`server.guard`).
        """
        data = pack(dict(rows))
        for worker in self._workers:
            worker.call("seed_guard", data)

    def take_guard_books(self) -> Counter[str]:
        """Return every worker's guard counts since the last call, added up; reset them."""
        total: Counter[str] = Counter()
        for worker in self._workers:
            total.update(worker.call("guard_books"))
        return total

    def refusals(self) -> Counter[str]:
        """Frames refused by every worker, by reason."""
        total: Counter[str] = Counter()
        for worker in self._workers:
            try:
                total.update(worker.call("refusals"))
            except WorkerError:
                continue
        return total

    def stop(self) -> None:
        """Stop every worker process."""
        for worker in self._workers:
            worker.stop()

