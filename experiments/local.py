"""Run the real apps in this process: the attack table's and the benchmarks' engine.

:class:`LocalGrid` is Flower's ``Grid`` interface over the very ClientApp that
Flower's engines run, called in this process (``concurrency`` clients at a time,
in threads) with a ``Context`` per node kept across rounds, as a SuperNode keeps
it (off the wire, as a SuperNode hands it to each message's fresh ClientApp
process). Its clients reach the trunk through the in-process channel: the same frames
and checks as gRPC, no network. Everything else is the shipped path: the
protocol's strategy, the ServerApp's runtime and reporter, the run folder. It is
not a Flower engine (no Ray, no SuperLink); tests of the deployment path use
those.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.serde import context_from_proto, context_to_proto
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity
from omegaconf import DictConfig, OmegaConf

from clients.app import ChannelFactory, build_client_app, trunk_channel
from server.app import SplitRuntime, TrainingResult, run_training, start_runtime, stop_runtime
from splitlearn.config import RunSpec
from splitlearn.dataplane import InProcessTransport, TrunkChannel, TrunkEndpoint

#: Flower's error code for a ClientApp that raised (as its engines report it).
CLIENT_APP_RAISED_EXCEPTION = 2
_RUN_ID = 1


class LocalGrid(Grid):
    """Delivers messages to a ClientApp in this process.

    Parameters
    ----------
    client_app : ClientApp
        The ClientApp to call.
    num_nodes : int
        Nodes, with partitions ``0 .. num_nodes - 1``.
    concurrency : int
        Messages handled at once (threads).
    """

    def __init__(self, client_app: ClientApp, *, num_nodes: int, concurrency: int = 1) -> None:
        self.client_app = client_app
        self.concurrency = concurrency
        self.contexts = {
            node: Context(run_id=_RUN_ID, node_id=node, node_config={
                "partition-id": node - 1, "num-partitions": num_nodes,
            }, state=RecordDict(), run_config={})
            for node in range(1, num_nodes + 1)
        }
        # Messages are stamped with the task's identity, as Flower's own runtimes set it.
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, _RUN_ID, 0

    def _deliver(self, message: Message) -> Message:
        # Each node decodes its own copy off the wire: one sent content is shared by many
        # messages (Flower's SecAgg+ stages), and a ClientApp may change what it is handed.
        message = copy.deepcopy(message)
        node = message.metadata.dst_node_id
        # A SuperNode hands each message's ClientApp process the node's Context off the
        # wire and keeps what comes back the same way: what the state holds must survive it.
        context = _over_the_wire(self.contexts[node])
        try:
            return self.client_app(message, context)
        except Exception as err:  # noqa: BLE001 - a failing ClientApp is an error reply
            error = Error(code=CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(err).__name__}: {err}")
            return Message(error, reply_to=message)
        finally:
            self.contexts[node] = _over_the_wire(context)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Handle every message, ``concurrency`` at a time, in node order; return the replies.

        Flower samples nodes in a random order; delivering by node id makes a run
        with ``concurrency=1`` repeatable.
        """
        ordered = sorted(messages, key=lambda m: m.metadata.dst_node_id)
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._deliver, ordered))

    def get_node_ids(self) -> Iterable[int]:
        """All nodes."""
        return list(self.contexts)

    def set_run(self, run):  # noqa: ANN001, ANN201, D102 - nothing to set: one run
        return None

    @property
    def run(self):  # noqa: ANN201, D102
        raise NotImplementedError("a LocalGrid has no Flower run")

    def create_message(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201, D102
        raise NotImplementedError("strategies build their messages themselves")

    def push_messages(self, messages):  # noqa: ANN001, ANN201, D102
        raise NotImplementedError("use send_and_receive")

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201, D102
        raise NotImplementedError("use send_and_receive")


def _over_the_wire(context: Context) -> Context:
    """Return ``context`` as a process receives it from another (Flower's serialisation)."""
    return context_from_proto(context_to_proto(context))


def in_process_channels(endpoint: TrunkEndpoint):  # noqa: ANN201 - a ChannelFactory
    """Open each session on ``endpoint`` directly (same frames and checks, no network)."""

    def open_channel(address: str, token: str, spec: RunSpec, *,
                     proof: bytes | None = None) -> TrunkChannel:
        return TrunkChannel(
            InProcessTransport(endpoint, token, proof=proof), reply_timeout_s=spec.reply_timeout_s,
            max_frame_bytes=spec.max_frame_bytes, compression=spec.compression,
        )

    return open_channel


def shipped_client_app(channels: ChannelFactory, runtime: SplitRuntime) -> ClientApp:
    """Build the shipped ClientApp, its sessions opened by ``channels`` (the default)."""
    return build_client_app(channels)


def run_local(cfg: DictConfig, *, concurrency: int = 1,
              grid_type: type[LocalGrid] = LocalGrid,
              client_app: Callable[[ChannelFactory, SplitRuntime], ClientApp] = shipped_client_app,
              ) -> TrainingResult:
    """Run ``cfg`` through the shipped strategy, runtime and ClientApp, in this process.

    ``cfg.run_dir`` is used when set; otherwise the run folder is temporary (and
    gets no plots: nobody would see them, and drawing them costs seconds), set on a
    copy of ``cfg``, so the caller's config never names the deleted folder. With
    trunk workers (``dataplane.trunk_workers`` > 1) the trunk lives in other processes,
    so the clients reach it over gRPC. ``grid_type`` may be a :class:`LocalGrid`
    subclass that also watches the messages (tests capture what the server receives);
    ``client_app`` builds what the grid calls, from the run's channel factory and runtime
    (the poisoning suite's lying devices wrap the shipped ClientApp there).
    """
    with tempfile.TemporaryDirectory(prefix="local-run-") as tmp:
        if OmegaConf.is_missing(cfg, "run_dir"):
            cfg = copy.deepcopy(cfg)
            cfg.run_dir = tmp
            cfg.logger.plots = False
        runtime = start_runtime(cfg)
        try:
            channels = (trunk_channel if runtime.workers is not None
                        else in_process_channels(runtime.endpoint))
            grid = grid_type(client_app(channels, runtime), num_nodes=cfg.num_clients,
                             concurrency=concurrency)
            return run_training(grid, runtime)
        finally:
            stop_runtime(runtime)
