"""The Flower ClientApp: one training and one evaluation handler, for every protocol.

Each message names its protocol in its type (``train.<protocol>``) and carries the
client-side weights, the run spec and the round's data (round, cut and, for split
protocols, the trunk's address and a session token). The handler builds the
protocol's client step, runs the one client loop (:mod:`clients.loop`) and replies
with the updated client-side weights and the standard metrics. The ClientApp holds
no model between messages; a node's privacy accountant lives in ``context.state``.

A device that cannot or may not finish (unavailable, vanished, out of memory, out
of privacy budget, asked for less privacy than its own floor, refused by the trunk)
raises a typed exception, and :func:`status_mod` turns it into a reply with a
``status`` record: the server reads the status from a field, never from an error
text, and ``context.state`` (the privacy spend) is kept because the round did not
fail.
"""

from __future__ import annotations

import base64
import math
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from typing import Protocol as TypingProtocol

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM
from torch.utils.data import DataLoader, TensorDataset

from clients.device import (
    PROFILE_KEY,
    ClientUnavailable,
    DeviceDeadline,
    DeviceFailure,
    DevicePlan,
    InjectedDropout,
    MemoryBudgetExceeded,
    Pacer,
    declared_profile,
    device_profile,
    measured_time,
    plan_round,
    virtual_time,
)
from clients.loop import TrainReport, epoch_loader, evaluate_round, train_round
from clients.relay import (
    RELAY_KEY,
    RUNTIME_KEY,
    SECRET_KEY,
    SLOT_KEY,
    WEB_RUNTIME,
    PhoneFailed,
    delegate,
    holding,
)
from clients.secagg import clip_update, secaggplus_mod, secure_train_handler
from clients.steps.base import ClientStep
from clients.steps.executorch import client_step_type
from clients.steps.web import (
    classes_seen,
    finish_on_phone,
    own_examples,
    phone_failure,
    phone_task,
    web_step_type,
)
from protocols import PROTOCOLS, Protocol
from splitlearn.config import RunSpec, decode_spec
from splitlearn.data import client_dataset, describe_dataset, local_dataset
from splitlearn.data.cache import PROCESS_DATA, cached_dataset
from splitlearn.dataplane import (
    WEBSOCKET_SCHEMES,
    GrpcTransport,
    TrunkChannel,
    TrunkRejected,
    WebSocketTransport,
)
from splitlearn.dataplane.feedback import ReferenceFeedback
from splitlearn.dataplane.node_keys import (
    NODE_KEY_QUERY,
    NODE_KEY_RECORD,
    PUBLIC_KEY_FIELD,
    new_private_key,
    prove,
    public_key_of,
)
from splitlearn.messages import (
    DECLARED_PROFILE_RECORD,
    RECOMPUTE_KEY,
    ROUND_KEY,
    SPEC_KEY,
    STATUS_KEY,
    UPDATE_WEIGHT_KEY,
    record_bytes,
    record_to_state,
    state_to_record,
)
from splitlearn.models.factory import build_model_from_config
from splitlearn.optim import scale_lr
from splitlearn.planning.devices import DeviceProfile
from splitlearn.privacy import (
    PRIVACY_OPTIONS,
    PrivacyAccountant,
    PrivacyBudgetExhausted,
    make_client_privacy,
    secret_generator,
)
from splitlearn.privacy.accounting import Step
from splitlearn.privacy.floor import PrivacyFloor, PrivacyFloorViolation
from splitlearn.privacy.labels import randomized_labels
from splitlearn.privacy.ledger import LEDGER_KEY, load_label_secret, load_ledger, save_ledger

#: ``context.state`` key of this node's privacy accountant history.
ACCOUNTANT_STATE_KEY = "privacy-accountant"
#: ``context.state`` key of the secret this node's labels are randomised with.
LABEL_SECRET_STATE_KEY = "label-secret"
#: ``context.state`` key of the accountant of the gradients a U-shaped node returns.
GRADIENT_ACCOUNTANT_STATE_KEY = "gradient-accountant"
#: ``context.state`` key of this node's data-plane key pair (see splitlearn.dataplane.node_keys).
NODE_KEY_STATE_KEY = "node-key"
#: ``context.state`` key of the device's error-feedback references (kept across rounds).
FEEDBACK_STATE_KEY = "error-feedback"
#: ... and U-shaped's references of the trunk's features.
FEATURE_FEEDBACK_STATE_KEY = "error-feedback-features"


class ChannelFactory(TypingProtocol):
    """Opens the round's data-plane session: (trunk address, token, spec) -> channel."""

    def __call__(self, address: str, token: str, spec: RunSpec, *,
                 proof: bytes | None = None) -> TrunkChannel:
        """Open it; ``proof`` is this node's for ``token`` (needed if bound to its key)."""
        ...


#: Node-config key of a device's own training data (parquet; see splitlearn.data.local_dataset).
DATA_KEY = "data-path"
#: Node-config key of the folder where a device keeps its training data between rounds.
CACHE_KEY = "cache-dir"
#: Node-config key of the PEM file this node verifies the trunk by (it then requires TLS).
TRUNK_ROOTS_KEY = "trunk-root-certificates"
#: Node-config key of how this node reaches the trunk: "grpc" (the default) or "websocket"
#: (the service browsers use, served with dataplane.websocket_port).
TRANSPORT_KEY = "trunk-transport"


def trunk_channel(address: str, token: str, spec: RunSpec, *,
                  proof: bytes | None = None) -> TrunkChannel:
    """Open a channel to the trunk service (TLS when the spec says so).

    ``host:port`` dials its gRPC stream; a ``ws://`` or ``wss://`` URL its WebSocket
    service (the same frames, as browsers send them).
    """
    roots = spec.trunk_root_certificates.encode() or None
    transport: GrpcTransport | WebSocketTransport
    if address.startswith(WEBSOCKET_SCHEMES):
        transport = WebSocketTransport(address, token, max_frame_bytes=spec.max_frame_bytes,
                                       root_certificates=roots, proof=proof)
    else:
        transport = GrpcTransport(
            address, token, max_frame_bytes=spec.max_frame_bytes,
            stream_timeout_s=spec.strategy.round_timeout_s,
            tls=spec.trunk_tls, root_certificates=roots, proof=proof,
        )
    return TrunkChannel(
        transport, reply_timeout_s=spec.reply_timeout_s, max_frame_bytes=spec.max_frame_bytes,
        compression=spec.compression,
    )


@dataclass(frozen=True)
class ClientRound:
    """What a message asks of this node."""

    protocol: Protocol
    spec: RunSpec
    server_round: int
    cut: int
    recompute: bool
    token: str
    trunk_address: str
    partition_id: int
    num_partitions: int
    declared: DeviceProfile | None = None  # a real device's own profile (node config)
    data_path: str | None = None  # a device's own data (node config data-path)
    cache_dir: str | None = None  # where the device keeps its data between rounds (cache-dir)
    label_secret: int | None = None  # privacy.label_epsilon: seeds the node's label draw
    node_key: bytes | None = None  # this node's data-plane private key, once it has one
    max_steps: int | None = None  # partial work: the planner's cap on this round's batches
    deadline_s: float | None = None  # partial work: the round's deadline on the device's clock
    min_work: float = 1.0  # ... and the least share of its round it trains
    runtime: str = "eager"  # node config device-runtime: "web" for a phone (clients.gateway)
    own_examples: int | None = None  # a phone training on its person's own pictures: how many

    @classmethod
    def read(cls, msg: Message, context: Context) -> ClientRound:
        """Decode the message (OmegaConf checks the spec against the protocol's schema)."""
        # ``train.<protocol>``; a plain ``train`` is SecAgg+'s stage 2 (the round record names it)
        name = (msg.metadata.message_type.partition(".")[2]
                or str(msg.content[ROUND_KEY]["protocol"]))
        protocol = PROTOCOLS[name]
        spec = decode_spec(str(msg.content["config"][SPEC_KEY]), strategy=protocol.options)
        data = msg.content[ROUND_KEY]
        node = context.node_config
        runtime = str(node.get(RUNTIME_KEY, "") or "eager")
        # A phone's browser reaches the trunk only over its WebSocket service.
        transport = "websocket" if runtime == WEB_RUNTIME else node.get(TRANSPORT_KEY, "")
        address = trunk_address(data, str(transport or "grpc"))
        try:
            declared = declared_profile(str(node.get(PROFILE_KEY, "")))
        except ValueError as err:
            raise DeviceFailure(str(err)) from err
        partition = _partition(context)
        spec = with_device_privacy(spec, declared, **partition)
        try:
            scale_lr(spec.strategy, data.get("lr_factor", 1.0))
        except ValueError as err:
            raise DeviceFailure(str(err)) from err
        return cls(
            protocol, trunk_trust(spec, node, address=address),
            int(data["server_round"]), int(data["cut"]), bool(data.get(RECOMPUTE_KEY, False)),
            str(data.get("token", "")), address, **partition, declared=declared,
            data_path=str(node[DATA_KEY]) if node.get(DATA_KEY) else None,
            cache_dir=str(node[CACHE_KEY]) if node.get(CACHE_KEY) else None,
            label_secret=_label_secret(context) if spec.privacy.label_epsilon else None,
            node_key=_held_node_key(context),
            max_steps=int(data.get("max_steps", 0)) or None,
            deadline_s=_positive_or_none(data.get("deadline_s", 0.0)),
            min_work=share_of_round(data.get("min_work", 1.0)), runtime=runtime,
            own_examples=_phones_own_examples(node) if runtime == WEB_RUNTIME else None,
        )

    def proof(self) -> bytes | None:
        """Return a fresh proof of this node's key for the round's token (None: no key)."""
        return None if self.node_key is None else prove(self.node_key, self.token)

    def step(self, arrays: ArrayRecord) -> ClientStep:
        """Build the protocol's step on a fresh model holding the server's weights.

        Under ``devices.runtime=executorch`` the step trains through ExecuTorch's runtime,
        or the device refuses the round (DeviceFailure naming the option); a phone's step
        is the protocol's own, whose stages its page trains (:mod:`clients.steps.web`).
        """
        model = build_model_from_config(self.spec.model, self.spec.dataset)
        client = (web_step_type(self.protocol, self.spec, recompute=self.recompute)
                  if self.runtime == WEB_RUNTIME
                  else client_step_type(self.protocol, self.spec, recompute=self.recompute))
        step = client(model, self.spec, cut=self.cut, recompute=self.recompute)
        step.load(record_to_state(arrays))
        return step

    def loader(self) -> DataLoader:
        """Return this round's shuffled batches of the node's partition.

        Under activation noise the order is the node's secret (see
        :func:`~clients.loop.epoch_loader`); otherwise it is repeatable from the task.
        """
        data = self.dataset()
        if self.spec.compression.error_feedback:  # batches name their examples (by index)
            data = TensorDataset(*data.tensors, torch.arange(len(data)))
        secret = PRIVACY_OPTIONS[self.spec.privacy.name].protects_activations
        return epoch_loader(
            data, self.spec, server_round=self.server_round, partition_id=self.partition_id,
            generator=secret_generator() if secret else None,
        )

    def dataset(self) -> TensorDataset:
        """Return the node's data, its labels randomised under ``privacy.label_epsilon``.

        The data is the node's own (``data-path``), else its partition of the run's.
        Training and evaluation both see only the randomised labels, the same ones
        every round (see :mod:`splitlearn.privacy.labels`). For a phone that trains on
        its person's own pictures, which never leave it, the data is their count and shape
        only (zeros): what the round's batches, privacy accounting and memory check need.

        Raises
        ------
        DeviceFailure
            A phone's own pictures under ``privacy.label_epsilon`` (their labels are
            released on the phone, which randomises none).
        """
        if self.own_examples is not None:
            if self.spec.privacy.label_epsilon is not None:
                raise DeviceFailure("privacy.label_epsilon randomises the labels the ClientApp "
                                    "holds; this phone's own pictures and labels stay on it")
            dataset = self.spec.dataset
            shape = describe_dataset(dataset.name, image_size=dataset.image_size)
            return TensorDataset(
                torch.zeros(self.own_examples, shape.in_channels, shape.image_size,
                            shape.image_size),
                torch.zeros(self.own_examples, dtype=torch.long))
        return self._released_labels(self._raw_dataset())

    def _raw_dataset(self) -> TensorDataset:
        key = {"dataset": asdict(self.spec.dataset),
               "path": self.data_path or self.spec.dataset.path}
        if self.data_path is None:
            key |= {"partitioner": asdict(self.spec.partitioner), "seed": self.spec.seed,
                    "partition_id": self.partition_id, "num_partitions": self.num_partitions}
        if self.cache_dir is None:
            if self.data_path is not None:  # a device's own files: read as they are now
                return self._load_dataset()
            # A warm process serving one simulated device after another keeps their data.
            return PROCESS_DATA.get(key, self._load_dataset)
        # A fresh process per message (Deployment Engine): load once, read back after.
        # The files read (own data, or the dataset's local folder) are stamped too.
        return cached_dataset(self.cache_dir, key, self._load_dataset)

    def _load_dataset(self) -> TensorDataset:
        if self.data_path is None:
            return client_dataset(
                self.spec.dataset, self.spec.partitioner, seed=self.spec.seed,
                partition_id=self.partition_id, num_partitions=self.num_partitions,
            )
        try:
            return local_dataset(self.data_path, self.spec.dataset)
        except (OSError, ValueError) as err:
            raise DeviceFailure(f"{DATA_KEY}={self.data_path}: {err}") from err

    def _released_labels(self, data: TensorDataset) -> TensorDataset:
        epsilon = self.spec.privacy.label_epsilon
        if epsilon is None:
            return data
        assert self.label_secret is not None  # read() draws it whenever epsilon is set
        images, labels = data.tensors
        released = randomized_labels(
            labels, epsilon=epsilon, secret=self.label_secret,
            num_classes=describe_dataset(self.spec.dataset.name).num_classes)
        return TensorDataset(images, released)


def with_device_privacy(spec: RunSpec, declared: DeviceProfile | None, *, partition_id: int,
                        num_partitions: int) -> RunSpec:
    """Return ``spec`` with the privacy this device's class applies (``privacy.per_device``)."""
    if not spec.privacy.per_device:
        return spec
    profile = declared or device_profile(spec, partition_id=partition_id,
                                         num_partitions=num_partitions)
    return replace(spec, privacy=spec.privacy.for_device(profile.name if profile else None))


def trunk_address(round_record: Mapping[str, object], transport: str) -> str:
    """Return the address this node dials: the task's gRPC one, or its WebSocket URL.

    Raises
    ------
    DeviceFailure
        For an unknown transport, or ``websocket`` when the trunk serves none.
    """
    if transport == "grpc":
        return str(round_record.get("trunk_address", ""))
    if transport != "websocket":
        raise DeviceFailure(f'{TRANSPORT_KEY}="{transport}": expected "grpc" or "websocket"')
    url = str(round_record.get("trunk_websocket", ""))
    if round_record.get("trunk_address") and not url:
        raise DeviceFailure(f'{TRANSPORT_KEY}="websocket", but the trunk serves no WebSocket '
                            "(the server sets dataplane.websocket_port)")
    return url


def trunk_trust(spec: RunSpec, node_config: Mapping[str, object], *, address: str) -> RunSpec:
    """Return ``spec`` with the roots this node verifies the trunk by.

    A node with its own roots (node config ``trunk-root-certificates``) uses
    only those, and refuses (TrunkRejected) a task whose trunk is not TLS: the
    server cannot talk it into plaintext or into trusting another certificate.
    Otherwise the task's roots apply (they came over the authenticated Flower link).
    """
    path = node_config.get(TRUNK_ROOTS_KEY)
    if not path:
        return spec
    if address and not spec.trunk_tls:
        raise TrunkRejected(f"the task's trunk at {address} does not serve TLS; this node "
                            f"requires it ({TRUNK_ROOTS_KEY}={path})")
    try:
        roots = Path(str(path)).read_text()
    except OSError as err:
        raise TrunkRejected(f"{TRUNK_ROOTS_KEY}={path}: cannot read it ({err})") from err
    return replace(spec, trunk_tls=True, trunk_root_certificates=roots)


def _phones_own_examples(node: Mapping[str, object]) -> int | None:
    """Ask the gateway what this node's phone holds: its own pictures' count, or None."""
    try:
        held = holding(str(node.get(RELAY_KEY, "")), slot=int(node.get(SLOT_KEY, -1)),
                       secret=str(node.get(SECRET_KEY, "")))
    except PhoneFailed as failed:
        raise phone_failure(failed) from failed
    return own_examples(held)


def _partition(context: Context) -> dict[str, int]:
    # The SuperNode's node config says which share of the data this node holds.
    return {
        "partition_id": int(context.node_config["partition-id"]),
        "num_partitions": int(context.node_config["num-partitions"]),
    }


def _charge_returned_gradients(context: Context, spec: RunSpec) -> float | None:
    """Charge the round's noised returned gradients; return epsilon so far (None: not noised).

    A U-shaped device returns each example's gradient row once per local epoch, clipped
    to C and noised with std sigma x C; as a function of the example's label (the rest
    given) the row moves by at most 2C, so each release is a Gaussian mechanism of
    multiplier sigma / 2 at sample rate 1, kept in ``context.state`` across rounds.
    """
    settings = spec.privacy
    if not settings.gradient_noise_multiplier:
        return None
    record = context.state.config_records.get(GRADIENT_ACCOUNTANT_STATE_KEY)
    accountant = PrivacyAccountant() if record is None else PrivacyAccountant.from_lists(record)
    accountant.spend([(settings.gradient_noise_multiplier / 2, 1.0, spec.strategy.local_epochs)],
                     delta=settings.delta, epsilon_max=None)
    context.state[GRADIENT_ACCOUNTANT_STATE_KEY] = ConfigRecord(accountant.to_lists())
    return accountant.epsilon(settings.delta)


def _held_node_key(context: Context) -> bytes | None:
    """Return this node's data-plane private key, if a ``query.node_key`` made one."""
    record = context.state.config_records.get(NODE_KEY_STATE_KEY)
    return None if record is None else bytes(record["private"])  # type: ignore[arg-type]


def node_key_reply(msg: Message, context: Context) -> Message:
    """Answer ``query.node_key`` with this node's data-plane public key.

    The key pair is made on the first query and kept in ``context.state`` for the run:
    Flower's node authentication vouches that the reply is this node's, and the tokens
    the ServerApp then grants this node are bound to the key (see
    :mod:`splitlearn.dataplane.node_keys`).
    """
    private = _held_node_key(context)
    if private is None:
        private = new_private_key()
        context.state[NODE_KEY_STATE_KEY] = ConfigRecord({"private": private})
    public = ConfigRecord({PUBLIC_KEY_FIELD: public_key_of(private)})
    return Message(content=RecordDict({NODE_KEY_RECORD: public}), reply_to=msg)


def with_declared_profile(content: RecordDict, context: Context) -> RecordDict:
    """Add the preset this device declared (node config ``device-profile``) to a reply.

    The server's client rows then name the preset the device said it is, not the
    fleet the run emulates (``devices``), which real devices are no part of.
    """
    name = str(context.node_config.get(PROFILE_KEY, "") or "")
    if name:
        content[DECLARED_PROFILE_RECORD] = ConfigRecord({"name": name})
    return content


def _label_secret(context: Context) -> int:
    """Return the secret this node randomises its labels with (drawn once, then kept).

    Beside the node's ledger when it keeps one (so restarts and new runs on the same
    data draw the same labels), else in ``context.state`` (kept across rounds).
    """
    ledger = context.node_config.get(LEDGER_KEY)
    if ledger:
        return load_label_secret(str(ledger))
    record = context.state.config_records.get(LABEL_SECRET_STATE_KEY)
    if record is None:
        record = ConfigRecord({"secret": secrets.randbits(63)})
        context.state[LABEL_SECRET_STATE_KEY] = record
    return int(record["secret"])


def _restore_feedback(context: Context, channel: TrunkChannel | None, spec: RunSpec, *,
                      cut: int) -> int:
    """Give the channel the error-feedback rows this device kept from earlier rounds.

    Only those kept at ``cut``: at another cut they are references of another layer's
    values (even where the shapes agree), and the device starts over from zero (so does
    the trunk, told by version 0, instead of refusing the first batch as stale).

    Returns
    -------
    int
        The examples whose references the device carries into this round (0: it starts
        from zero).
    """
    if channel is None or not spec.compression.error_feedback:
        return 0
    records = context.state.array_records
    bound = spec.compression.feedback_max_bytes
    kept = {key: record_to_state(records[key])
            for key in (FEEDBACK_STATE_KEY, FEATURE_FEEDBACK_STATE_KEY) if key in records}
    kept = {key: state for key, state in kept.items() if int(state.get("cut", -1)) == cut}
    if channel.feedback is not None and FEEDBACK_STATE_KEY in kept:
        channel.feedback = ReferenceFeedback.from_state(kept[FEEDBACK_STATE_KEY], max_bytes=bound)
    if FEATURE_FEEDBACK_STATE_KEY in kept:
        channel.feature_feedback = ReferenceFeedback.from_state(
            kept[FEATURE_FEEDBACK_STATE_KEY], max_bytes=bound)
    memories = (channel.feedback, channel.feature_feedback)
    return max((len(m.references) for m in memories if m is not None), default=0)


def _keep_feedback(context: Context, channel: TrunkChannel, *, cut: int) -> None:
    """Keep the channel's error-feedback rows, and the cut they are at, for the next round.

    Also after a failed round: the version tells the trunk whether they are still its own.
    Not rows that moved for a frame the trunk never acknowledged: should this device later
    start from older rows (a round whose state was lost), they could reach the trunk's
    version by another path and pass for its rows. Then the next round starts from zero.
    """
    for key, memory in ((FEEDBACK_STATE_KEY, channel.feedback),
                        (FEATURE_FEEDBACK_STATE_KEY, channel.feature_feedback)):
        if memory is not None and channel.feedback_settled:
            context.state[key] = state_to_record(memory.state() | {"cut": torch.tensor(cut)})
        elif key in context.state:
            del context.state[key]


def _load_accountant(context: Context) -> PrivacyAccountant:
    """Return the node's accountant: from its ledger file if it keeps one, else its state."""
    ledger = context.node_config.get(LEDGER_KEY)
    if ledger:
        return load_ledger(str(ledger))
    # context.state persists per node across rounds (not restarts), so epsilon adds up.
    record = context.state.config_records.get(ACCOUNTANT_STATE_KEY)
    return PrivacyAccountant() if record is None else PrivacyAccountant.from_lists(record)


def _charge(context: Context, accountant: PrivacyAccountant, steps: list[Step], *,
            spec: RunSpec, floor: PrivacyFloor) -> None:
    """Charge ``steps`` (declining past the budget) and keep the spend before anything leaves."""
    if not steps:
        return
    accountant.spend(steps, delta=spec.privacy.delta,
                     epsilon_max=floor.budget(spec.privacy.epsilon_max))
    context.state[ACCOUNTANT_STATE_KEY] = ConfigRecord(accountant.to_lists())
    ledger = context.node_config.get(LEDGER_KEY)
    if ledger:
        save_ledger(str(ledger), accountant)


def _privacy_floor(context: Context, spec: RunSpec) -> PrivacyFloor:
    """Return this node's own privacy floor, refusing a task below it (before any work)."""
    floor = PrivacyFloor.from_node_config(context.node_config)
    floor.check(spec.privacy)
    return floor


def _dropout_hook(plan: DevicePlan, channel: TrunkChannel | None) -> Callable[[int], None]:
    def on_step(step: int) -> None:
        if 0 <= plan.fail_after_steps <= step:
            if channel is not None:
                channel.abort()  # the device vanishes: no clean stream close
            raise InjectedDropout(f"vanished after {step} steps")

    return on_step


def train(rnd: ClientRound, msg: Message, context: Context, open_channel: ChannelFactory
          ) -> Message:
    """One round of the message's protocol on this node."""
    entered = time.perf_counter()
    spec = rnd.spec
    floor = _privacy_floor(context, spec)
    floor.check_aggregation(secure=msg.metadata.message_type == MessageType.TRAIN)
    torch.set_num_threads(spec.torch_threads)
    plan = plan_round(spec, server_round=rnd.server_round, partition_id=rnd.partition_id,
                      num_partitions=rnd.num_partitions, declared=rnd.declared)
    if not plan.available:
        raise ClientUnavailable(f"device not reachable in round {rnd.server_round}")
    step = rnd.step(msg.content["arrays"])
    loader = rnd.loader()
    memory = step.memory_bytes(spec.strategy.batch_size)
    examples = len(loader.dataset)  # type: ignore[arg-type]
    kept = step.kept_bytes(examples, spec.compression)  # references, batches kept: all round
    plan.check_memory(memory + kept, what=f"{rnd.protocol.name} at cut {rnd.cut}, batch "
                      f"{spec.strategy.batch_size}"
                      + (" with recomputation" if rnd.recompute else "")
                      + (" and the rows it keeps" if kept else ""),
                      examples=examples)
    privacy = make_client_privacy(spec.privacy, loader)
    privacy.check_source(step.bottom)
    accountant = _load_accountant(context)
    try:
        # The whole round is charged before anything leaves the device (a partial round,
        # max_steps, is charged as a whole one: an upper bound on what it releases).
        _charge(context, accountant, privacy.round_steps(epochs=spec.strategy.local_epochs),
                spec=spec, floor=floor)
        gradient_epsilon = _charge_returned_gradients(context, spec)
        pacer = _pacer(rnd, plan)
        started = time.perf_counter()  # the part of the round the virtual clock models
        if pacer is not None:  # the device first waits for its weights
            pacer.transfer(bytes_down=record_bytes(msg.content["arrays"]))
        seen = None  # how many classes a phone's own pictures span
        if rnd.runtime == WEB_RUNTIME:  # the phone's page trains; the rest is as here
            channel, carried = None, 0
            report, seen = _train_on_phone(rnd, step, loader, context)
        else:
            channel = (open_channel(rnd.trunk_address, rnd.token, spec, proof=rnd.proof())
                       if step.needs_channel else None)
            carried = _restore_feedback(context, channel, spec, cut=rnd.cut)
            deadline = _deadline(rnd, plan, weights_bytes=record_bytes(msg.content["arrays"]),
                                 batches=len(loader) * spec.strategy.local_epochs)
            try:
                report = train_round(step, channel, privacy, epochs=spec.strategy.local_epochs,
                                     on_step=_dropout_hook(plan, channel), pacer=pacer,
                                     max_steps=rnd.max_steps, deadline=deadline,
                                     count_flops=_counts_flops(rnd, plan))
            finally:
                if channel is not None:
                    _keep_feedback(context, channel, cut=rnd.cut)
                    channel.close()
    finally:
        privacy.close()
    # DP-FedAvg: the update leaves clipped to the bound the task names.
    arrays = clip_update(state_to_record(step.state()), msg.content["arrays"],
                         msg.content["config"])
    weights = Traffic(down=record_bytes(msg.content["arrays"]), up=record_bytes(arrays))
    if pacer is not None:  # ... and last sends them back
        pacer.transfer(bytes_up=weights.up)
    metrics = _train_metrics(rnd, plan, report, memory, weights)
    # A whole round's work, which the planner plans with even when it asked for part of it.
    metrics["round-examples"] = examples * spec.strategy.local_epochs
    metrics["examples-held"] = examples
    metrics["round-steps"] = len(loader) * spec.strategy.local_epochs
    # The device's own wall time (waiting for the trunk is the trunk's, charged per round):
    # with devices.emulate, what virtual-s predicts.
    metrics["device-wall-s"] = time.perf_counter() - started - report.wait_s
    # Where the handler's time went (the round's time budget): building the step, the
    # data and the privacy engine before training, then the whole handler.
    metrics["setup-s"] = started - entered
    coverage = (label_coverage(loader.dataset, step.model.num_classes) if seen is None
                else seen / step.model.num_classes)
    for key, value in _fleet_metrics(plan, step, coverage).items():
        metrics[key] = value
    if spec.privacy.accounted:
        metrics["epsilon"] = accountant.epsilon(spec.privacy.delta)
        metrics["epsilon-vs-server"] = accountant.epsilon_unamplified(spec.privacy.delta)
    if spec.privacy.label_epsilon:
        metrics["label-epsilon"] = spec.privacy.label_epsilon
    if gradient_epsilon is not None:
        metrics["gradient-epsilon"] = gradient_epsilon
    if KEY_CLIPPING_NORM in msg.content["config"]:
        metrics[UPDATE_WEIGHT_KEY] = 1.0  # DP-FedAvg averages devices uniformly
    if channel is not None and spec.compression.error_feedback:
        metrics["feedback-restarts"] = channel.restarts  # 0 while both sides stay in step
        metrics["feedback-carried"] = carried  # rows kept in context.state since last round
    metrics["handler-s"] = time.perf_counter() - entered
    content = RecordDict({"arrays": arrays, "metrics": metrics})
    for key, arrays in step.reply_arrays().items():
        content[key] = state_to_record(arrays)
    return Message(content=with_declared_profile(content, context), reply_to=msg)


def _train_on_phone(rnd: ClientRound, step: ClientStep, loader: DataLoader,
                    context: Context) -> tuple[TrainReport, int | None]:
    """Hand the round to this node's phone through the gateway (see clients.relay).

    Returns its report and, for a phone training on its own pictures, how many classes
    they span (None otherwise).
    """
    node, spec = context.node_config, rnd.spec
    epochs = spec.strategy.local_epochs
    proof = rnd.proof()
    built: dict[str, Any] = {}

    def task(holds: str | None) -> dict[str, Any]:  # once the gateway says what it holds
        if own_examples(holds) != rnd.own_examples:  # the round was built for other data
            raise DeviceFailure("phone: its pictures changed since the round started")
        built.update(phone_task(
            step, rnd.protocol, loader, server_round=rnd.server_round, epochs=epochs,
            trunk={"url": rnd.trunk_address, "token": rnd.token,
                   "proof": None if proof is None else base64.b64encode(proof).decode("ascii")},
            max_steps=rnd.max_steps, deadline_s=rnd.deadline_s,
            least_steps=least_steps(rnd.min_work, len(loader) * epochs), holds=holds))
        return built

    try:
        result = delegate(str(node.get(RELAY_KEY, "")), slot=int(node.get(SLOT_KEY, -1)),
                          secret=str(node.get(SECRET_KEY, "")), task=task,
                          timeout_s=spec.strategy.round_timeout_s)
    except PhoneFailed as failed:
        raise phone_failure(failed) from failed
    done = finish_on_phone(step, built, result)
    examples, steps = int(done["examples"]), int(done["steps"])
    report = TrainReport(
        examples=examples, steps=steps, loss=done["loss_sum"] / max(examples, 1),
        accuracy=done["correct"] / max(examples, 1), compute_s=done["compute_s"],
        wall_s=done["wall_s"], bytes_up=int(done["bytes_up"]), bytes_down=int(done["bytes_down"]),
        exchanges=steps * step.exchanges_per_batch, wait_s=done["wait_s"])
    return report, classes_seen(built, result)


@dataclass(frozen=True)
class Traffic:
    """Bytes of the client-side weights in the round's Flower message and its reply."""

    down: int
    up: int


def _counts_flops(rnd: ClientRound, plan: DevicePlan) -> bool:
    """Whether the clock charges this round's compute by its FLOPs (``devices.compute_time``).

    Only where torch runs the step: ExecuTorch's runtime executes outside torch's
    dispatch, so a count there would miss most of the work (its host seconds count).
    """
    return plan.emulated and plan.profile is not None and (
        rnd.spec.devices.compute_time == "flops" and rnd.spec.devices.runtime == "eager")


def _pacer(rnd: ClientRound, plan: DevicePlan) -> Pacer | None:
    """Return the pacer that makes this round take the device's time (``devices.emulate``)."""
    if not rnd.spec.devices.emulate or plan.profile is None or not plan.emulated:
        return None
    return Pacer(plan.profile, host_flops_per_s=rnd.spec.devices.host_flops_at(rnd.cut))


def _deadline(rnd: ClientRound, plan: DevicePlan, *, weights_bytes: int, batches: int
              ) -> DeviceDeadline | None:
    """Return the round's deadline on this device's clock (partial work), if it has one.

    An emulated device counts on the virtual clock (its weights' transfers included), a
    real one its own wall time; either trains at least ``min_work`` of its ``batches``.
    """
    if rnd.deadline_s is None:
        return None
    least = least_steps(rnd.min_work, batches)
    if plan.emulated and plan.profile is not None:
        return DeviceDeadline.emulated(
            plan.profile, host_flops_per_s=rnd.spec.devices.host_flops_at(rnd.cut),
            deadline_s=rnd.deadline_s, least_steps=least, weights_bytes=weights_bytes)
    return DeviceDeadline.measured(deadline_s=rnd.deadline_s, least_steps=least)


def least_steps(min_work: float, batches: int) -> int:
    """Return the fewest batches a device with a deadline trains: ``min_work`` of them, >= 1."""
    return max(1, math.ceil(min_work * batches - 1e-9))


def share_of_round(value: object) -> float:
    """Return a share in [0, 1] from a record; anything else (NaN, not a number) is 1: whole."""
    share = _finite_or_none(value)
    return 1.0 if share is None else min(max(share, 0.0), 1.0)


def _positive_or_none(value: object) -> float | None:
    """Return a positive float from a record, or None (0, missing or not a number: none)."""
    number = _finite_or_none(value)
    return number if number is not None and number > 0 else None


def _finite_or_none(value: object) -> float | None:
    """Return a record's value as a finite float, or None (missing, NaN, not a number)."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _train_metrics(rnd: ClientRound, plan: DevicePlan, report: TrainReport, memory: int,
                   weights: Traffic) -> MetricRecord:
    # The weights travel too (in the Flower messages): the clock charges them, so a
    # deeper cut pays for its larger client side and a moved cut for the stages it gets.
    work = report.measurement
    work = replace(work, bytes_up=work.bytes_up + weights.up,
                   bytes_down=work.bytes_down + weights.down)
    vtime = (virtual_time(work, profile=plan.profile,
                          host_flops_per_s=rnd.spec.devices.host_flops_at(rnd.cut))
             if plan.emulated else measured_time(work, wall_s=report.wall_s))
    return MetricRecord({
        "partition-id": rnd.partition_id, "cut": rnd.cut, RECOMPUTE_KEY: int(rnd.recompute),
        "virtual-s": vtime.total_s, "virtual-compute-s": vtime.compute_s,
        "virtual-upload-s": vtime.upload_s, "virtual-download-s": vtime.download_s,
        "virtual-latency-s": vtime.latency_s, "memory-bytes": memory,
        "num-examples": report.examples, "steps": report.steps,
        "train-loss": report.loss, "train-accuracy": report.accuracy,
        "compute-s": report.compute_s, "train-s": report.wall_s,
        "bytes-up": work.bytes_up, "bytes-down": work.bytes_down,
        "weights-bytes-up": weights.up, "weights-bytes-down": weights.down,
        # What the clock charged its compute by (0: its seconds, devices.compute_time).
        "flops": report.flops or 0.0,
    })


def _fleet_metrics(plan: DevicePlan, step: ClientStep, coverage: float) -> dict[str, float]:
    """Return what the planner learns of the device: budget, measured memory, data utility."""
    return {
        "memory-budget": float(plan.profile.memory_bytes) if plan.profile else 0.0,
        "peak-memory-bytes": float(getattr(step, "peak_memory_bytes", 0)),
        "label-coverage": coverage,
    }


def label_coverage(data: TensorDataset, num_classes: int) -> float:
    """Share of the model's classes present in this node's partition (SmartSplit's utility)."""
    return len(torch.unique(data.tensors[1])) / num_classes


def evaluate(rnd: ClientRound, msg: Message, context: Context, open_channel: ChannelFactory
             ) -> Message:
    """Evaluate the protocol's pipeline on this node's data (no update)."""
    if rnd.own_examples is not None:
        raise DeviceFailure("a phone's own pictures never leave it, and its page does not "
                            "evaluate: it trains only")
    spec = rnd.spec
    floor = _privacy_floor(context, spec)
    torch.set_num_threads(spec.torch_threads)
    step = rnd.step(msg.content["arrays"])
    loader = rnd.loader()
    privacy = make_client_privacy(spec.privacy, loader)
    privacy.check_source(step.bottom)
    step.release = privacy.release  # evaluation frames leave as training frames do
    accountant = _load_accountant(context)
    try:
        if privacy.protects_activations:
            # An evaluation releases every local example once more: charged as an epoch,
            # before anything leaves, so a server cannot average repeated evaluations.
            _charge(context, accountant, privacy.round_steps(epochs=1), spec=spec, floor=floor)
        data = DataLoader(loader.dataset, batch_size=spec.strategy.batch_size)
        channel = (open_channel(rnd.trunk_address, rnd.token, spec, proof=rnd.proof())
                   if step.needs_channel else None)
        try:
            loss, accuracy, examples = evaluate_round(step, channel, data)
        finally:
            if channel is not None:
                channel.close()
    finally:
        privacy.close()
    metrics = MetricRecord({"num-examples": examples, "eval-loss": loss, "eval-accuracy": accuracy})
    if spec.privacy.accounted:
        metrics["epsilon"] = accountant.epsilon(spec.privacy.delta)
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


def status_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Turn a device's reason not to finish into a reply with a ``status`` record."""
    try:
        return call_next(msg, context)
    except (DeviceFailure, PrivacyBudgetExhausted, PrivacyFloorViolation, TrunkRejected
            ) as declined:
        metrics = MetricRecord({"partition-id": _partition(context)["partition_id"]})
        if isinstance(declined, PrivacyBudgetExhausted):
            metrics["epsilon"] = declined.epsilon_spent
        if isinstance(declined, MemoryBudgetExceeded):
            metrics["memory-budget"] = declined.budget_bytes
            metrics["examples-held"] = declined.examples
        content = RecordDict({
            STATUS_KEY: ConfigRecord({"status": declined.kind, "reason": str(declined)}),
            "metrics": metrics,
        })
        return Message(content=with_declared_profile(content, context), reply_to=msg)


def build_client_app(open_channel: ChannelFactory = trunk_channel) -> ClientApp:
    """Build the ClientApp; its data-plane sessions are opened by ``open_channel``."""
    # SecAgg+'s stages are plain ``train`` messages; its mod answers all but stage 2.
    app = ClientApp(mods=[status_mod, secaggplus_mod])
    for name in PROTOCOLS:
        for register, handler in ((app.train, train), (app.evaluate, evaluate)):
            register(name)(_bind(handler, open_channel))
    app.train()(secure_train_handler(_bind(train, open_channel), status_mod))
    app.query(NODE_KEY_QUERY.partition(".")[2])(node_key_reply)
    return app


def _bind(
    handler: Callable[[ClientRound, Message, Context, ChannelFactory], Message],
    open_channel: ChannelFactory,
) -> Callable[[Message, Context], Message]:
    def handle(msg: Message, context: Context) -> Message:
        return handler(ClientRound.read(msg, context), msg, context, open_channel)

    return handle


#: The ClientApp that ``flwr run .`` and ``experiments.run`` load.
app = build_client_app()
