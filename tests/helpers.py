"""Reference maths and small drivers shared by the tests."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence

import torch
from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid
from torch import Tensor, nn

from clients.app import node_key_reply
from clients.loop import TrainReport, train_round
from clients.steps.split import SplitStep
from protocols.splitfed import SplitFedV2Options
from splitlearn.config import PrivacyConfig, RunSpec
from splitlearn.dataplane import TrunkChannel
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.node_keys import NODE_KEY_QUERY
from splitlearn.models import SplittableModel
from splitlearn.planning.cost import ClientState, CutCost
from splitlearn.privacy import ClientPrivacy


def imports_in_a_fresh_process(code: str, module: str) -> bool:
    """Run ``code`` in a fresh interpreter (a failure fails the test); did it import ``module``?"""
    probe = f"{textwrap.dedent(code)}\nimport sys\nprint({module!r} in sys.modules)"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split()[-1] == "True"


def train_whole(model: nn.Module, batches: Sequence[tuple[Tensor, Tensor]], lr: float) -> None:
    """Plain SGD on the whole model: the reference split training must equal."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest absolute difference between two models' floating-point state."""
    return max(
        (pa - pb).abs().max().item()
        for pa, pb in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
        if pa.is_floating_point()
    )


def plain_spec(lr: float, *, momentum: float = 0.0, **options) -> RunSpec:
    """A run spec with plain SGD (what makes split training equal whole-model SGD)."""
    return RunSpec(strategy=SplitFedV2Options(lr=lr, momentum=momentum, **options))


def train_split_client(
    model: SplittableModel, cut: int, batches: Sequence[tuple[Tensor, Tensor]],
    channel: TrunkChannel, *, lr: float, on_step: Callable[[int], None] | None = None,
) -> TrainReport:
    """One epoch of the split protocol's client step over ``batches`` (``model`` trained)."""
    spec = plain_spec(lr)
    step = SplitStep(model, spec, cut=cut)
    return train_round(step, channel, ClientPrivacy(PrivacyConfig(), batches), epochs=1,
                       on_step=on_step)


def send_raw(channel: TrunkChannel, data: bytes) -> pb.Reply:
    """Send raw bytes on a channel's transport; return the trunk's reply."""
    channel.transport.send(data)
    return pb.Reply.FromString(channel.transport.receive(30.0))



class RecordingSends:
    """Keeps the ``feedback_version`` of every ``forward`` and ``smashed`` a channel sends."""

    def __init__(self, channel: TrunkChannel) -> None:
        self.versions: list[int] = []
        send = channel.transport.send

        def recording(data: bytes) -> None:
            sent = pb.Request.FromString(data)
            kind = sent.WhichOneof("kind")
            if kind in ("forward", "smashed"):
                self.versions.append(getattr(sent, kind).feedback_version)
            send(data)

        channel.transport.send = recording  # type: ignore[method-assign]


class ScriptedGrid(Grid):
    """A grid whose nodes answer by a script (``answer(message) -> reply``; None: never).

    Records every ``send_and_receive`` call (the messages as sent). With ``node_keys``
    the nodes answer ``query.node_key`` as the shipped ClientApp does (a key pair per
    node), and the script sees the rest. The rest of Flower's Grid interface is not
    needed by strategies and refuses to be used.
    """

    def __init__(self, nodes: list[int], answer: Callable[[Message], Message], *,
                 node_keys: bool = True) -> None:
        self.nodes = nodes
        self.answer = answer
        self.node_keys = node_keys
        self.calls: list[list[Message]] = []
        self._contexts: dict[int, Context] = {}

    def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN201
        messages = list(messages)
        for message in messages:  # ids as Flower's grids give them when they push
            message.metadata.__dict__["_message_id"] = message.object_id
        self.calls.append(messages)
        return [r for r in map(self._answer, messages) if r is not None]

    def _answer(self, message: Message) -> Message | None:
        if not self.node_keys or message.metadata.message_type != NODE_KEY_QUERY:
            return self.answer(message)
        node = message.metadata.dst_node_id
        context = self._contexts.setdefault(node, Context(
            run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={}))
        return node_key_reply(message, context)

    def train_calls(self) -> list[list[Message]]:
        return [c for c in self.calls if c and c[0].metadata.message_type.startswith("train.")]

    def get_node_ids(self):  # noqa: ANN201
        return list(self.nodes)

    def set_run(self, run):  # noqa: ANN001, ANN201
        raise NotImplementedError

    @property
    def run(self):  # noqa: ANN201
        raise NotImplementedError

    def create_message(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        raise NotImplementedError

    def push_messages(self, messages):  # noqa: ANN001, ANN201
        raise NotImplementedError

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
        raise NotImplementedError


def cut_cost(
    cut: int,
    *,
    client_flops: float,
    server_flops: float,
    memory: int = 0,
    recompute_memory: int | None = None,
    recompute_flops: float = 0.0,
    smashed: int = 0,
    params: int = 0,
    leak: float | None = None,
) -> CutCost:
    """A planner's cost row with only what a test sets (the rest zero)."""
    return CutCost(
        cut=cut,
        client_flops_per_sample=client_flops,
        recompute_flops_per_sample=recompute_flops,
        server_flops_per_sample=server_flops,
        smashed_bytes_per_sample=smashed,
        client_param_bytes=params,
        memory_bytes=memory,
        recompute_memory_bytes=memory if recompute_memory is None else recompute_memory,
        leak=leak,
    )


def client_state(
    name: str,
    *,
    flops: float = 1.0,
    memory: float = math.inf,
    link: float = 1.0,
    utility: float = 1.0,
    current_cut: int | None = None,
) -> ClientState:
    """A planner's client with one sample, one batch and no latency.

    Its round takes ``FLOPs / flops + 2 x (smashed + weights) / link`` seconds.
    """
    return ClientState(
        client=name, flops_per_s=flops, uplink_bytes_per_s=link, downlink_bytes_per_s=link,
        rtt_s=0.0, memory_bytes=memory, samples=1, batches=1, utility=utility,
        current_cut=current_cut,
    )
