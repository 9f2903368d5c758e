"""Typed configuration: the dataclass schemas of every setting, in one place.

``conf/config.yaml`` extends :class:`Config` and each ``conf/strategy/NAME.yaml``
its protocol's subclass of :class:`StrategyConfig` (registered with Hydra by
:func:`protocols.register_configs`), so a misspelt key or a value of the wrong type
fails when Hydra composes the config, with the key's full name in the message.
What a client needs travels to it as a :class:`RunSpec` made of the same
dataclasses, and OmegaConf checks it again on arrival (:func:`decode_spec`). This
module does not import Hydra, so a device does not need it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

#: Where the shipped YAML lives (travels with the source tree and the Flower FAB).
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


@dataclass
class DatasetConfig:
    """Which data to train on."""

    name: str = "digits"  # scikit-learn's digits ship with the package: works offline
    path: str | None = None  # local folder for flwr-datasets datasets (no download)
    test_fraction: float = 0.2  # digits only: held-out share, stratified
    image_size: int | None = None  # resize (bilinear) to this size; None = native
    # synthetic only: each device generates this many examples of its own, and how far
    # devices' inputs differ (0: one distribution for all)
    samples_per_client: int = 64
    skew: float = 0.0

    def __post_init__(self) -> None:
        if self.samples_per_client < 1:
            raise ValueError(f"dataset.samples_per_client={self.samples_per_client}: "
                             "need at least 1")
        if self.skew < 0:
            raise ValueError(f"dataset.skew={self.skew}: need at least 0")


@dataclass
class PartitionerConfig:
    """How the training data is split over clients (flwr-datasets partitioners)."""

    name: str = "iid"  # iid | dirichlet | shards
    alpha: float = 0.5  # Dirichlet concentration; smaller = more label skew
    shards_per_partition: int = 2  # pathological shards: classes per client, roughly


@dataclass
class ModelConfig:
    """The splittable network and where it is cut.

    ``name`` picks a network of the zoo. ``_target_`` instead names any
    ``nn.Module`` class (``mypkg.nets.MyNet``): it is built with ``options`` as
    keyword arguments and cut by ``splitlearn.models.autosplit.auto_split`` wherever a
    single tensor crosses; ``cut`` then counts those cut points.
    """

    name: str = "cnn"  # cnn | resnet | a zoo network; a label when _target_ is set
    _target_: str | None = None  # dotted path of a user's nn.Module class
    cut: int = 1  # stages [0, cut) run on the client
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the network


@dataclass
class OptimizerConfig:
    """One side's optimiser, named by Hydra's ``_target_`` (splitlearn/optim.py builds it).

    ``_target_`` is a ``torch.optim.Optimizer`` class by its dotted path. ``lr`` is the
    side's base learning rate (None: ``strategy.lr``), which ``strategy.schedule`` scales
    round by round. ``options`` are its other keyword arguments (``betas``, ``eps``, ...);
    ``strategy.weight_decay``, and for SGD ``strategy.momentum``, apply unless they set them.
    """

    _target_: str | None = "torch.optim.SGD"  # trunk_optimizer: None = the devices' optimiser
    lr: float | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class ScheduleConfig:
    """A learning-rate schedule over rounds, named by Hydra's ``_target_``.

    ``_target_`` is a ``torch.optim.lr_scheduler`` class (None: a constant rate), stepped
    once per round: round ``r`` trains both sides at their base rate times the factor it
    gives after ``r - 1`` steps. ``options`` are its keyword arguments; a ``T_max`` or
    ``total_iters`` it takes and they leave out is ``strategy.num_rounds``.
    """

    _target_: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class StrategyConfig:
    """Training settings every protocol shares; each protocol's subclass adds its options."""

    name: str = MISSING  # a protocol of protocols.PROTOCOLS (conf/strategy/NAME.yaml)
    num_rounds: int = 20
    fraction_train: float = 1.0  # share of connected clients sampled per round
    min_train_nodes: int = 2
    fraction_evaluate: float = 0.0  # federated evaluation; centralised eval runs anyway
    local_epochs: int = 2  # with 1, parallel clients need ~12 rounds to reach 97% on digits
    batch_size: int = 32
    lr: float = 0.05  # plain SGD on both sides, same lr: split == whole-model SGD
    momentum: float = 0.5  # 0.9 on the shared trunk stalls training under label skew
    weight_decay: float = 0.0
    # Devices' optimiser, and the trunk's (_target_ None: the devices'); SGD on both by default.
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trunk_optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(_target_=None))
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)  # lr over rounds
    round_timeout_s: float = 600.0  # Flower waits this long for replies


#: How a tensor at the cut may be encoded (see splitlearn/dataplane/compression.py).
COMPRESSION_METHODS = ("none", "float16", "bfloat16", "int8", "topk")


@dataclass
class CompressionConfig:
    """How the data plane encodes the tensors at the cut, per direction.

    Every row (example) is encoded on its own. ``float16``/``bfloat16``: 2 bytes
    a value; ``int8``: 1 byte a value and a float32 scale per row; ``topk``: the
    ``topk_fraction`` largest entries of each row by magnitude (bfloat16 values,
    16- or 32-bit positions), the rest zero.
    """

    name: str = "none"  # the config group option this came from
    uplink: str = "none"  # what devices send: smashed data (U-shaped: also d loss / d features)
    downlink: str = "none"  # what the trunk sends: the gradient at the cut (U-shaped: features)
    topk_fraction: float = 0.1  # topk: the share of each row's entries kept
    # Make up what compression drops on the example's next visit (split protocols, ushaped,
    # local_loss; the device sends each row's example id): see splitlearn/dataplane/feedback.py.
    error_feedback: bool = False
    # Trunk: all clients' rows together (past it, clients over an equal share are dropped,
    # least recently served first); device: its own.
    feedback_max_mib: float = 256.0

    def __post_init__(self) -> None:
        for key in ("uplink", "downlink"):
            if getattr(self, key) not in COMPRESSION_METHODS:
                raise ValueError(f"dataplane.compression.{key}={getattr(self, key)!r}: "
                                 f"expected one of {list(COMPRESSION_METHODS)}")
        if not 0.0 < self.topk_fraction <= 1.0:
            raise ValueError("dataplane.compression.topk_fraction must be in (0, 1], got "
                             f"{self.topk_fraction}")
        if self.error_feedback and self.uplink == self.downlink == "none":
            raise ValueError("dataplane.compression.error_feedback=true needs a lossy uplink or "
                             "downlink (both are none: nothing is dropped to feed back)")
        if not self.feedback_max_mib > 0:
            raise ValueError("dataplane.compression.feedback_max_mib must be > 0, got "
                             f"{self.feedback_max_mib}")

    @property
    def uplink_feedback(self) -> bool:
        """Whether activations travel as differences from per-example references."""
        return self.error_feedback and self.uplink != "none"

    @property
    def downlink_feedback(self) -> bool:
        """Whether the trunk feeds back what compression dropped from each example's gradient."""
        return self.error_feedback and self.downlink != "none"

    @property
    def feedback_max_bytes(self) -> int:
        """:attr:`feedback_max_mib` in bytes."""
        return int(self.feedback_max_mib * 2**20)


@dataclass
class GuardConfig:
    """Bounds on one device's influence on a shared trunk (server/guard.py)."""

    enabled: bool = True
    # A row (an example's activations, or a returned gradient) is refused beyond this many
    # times the median norm of recent rows at its cut (honest rows measured up to 8x: a
    # ResNet's cut 4; 1.5x for the CNN).
    row_factor: float = 20.0
    # ... unless within this many times the largest row the server's own examples gave there
    # this round (seeded, see server/guard.py). Returned gradients (U-shaped) are bounded by
    # that alone: they are heavy-tailed (a confident row's is ~1/100 of a misclassified
    # one's), and the median's bound refused honest ones from round 4; honest rows measured
    # up to 1.6x the seeded largest (per example).
    seed_factor: float = 4.0
    min_rows: int = 128  # rows seen at a cut before its bound applies (unless seeded)
    window_rows: int = 4096  # recent rows the bound is computed from
    # A trunk step's gradient norm is clipped to this many times the median of recent
    # steps' (0: not clipped).
    update_clip: float = 5.0
    min_steps: int = 20  # steps before clipping starts (a cut's losses: before they are checked)
    window_steps: int = 32  # recent steps the median is taken over (norms grow 10x in round 1-2)
    strikes: int = 2  # refused frames that quarantine a device for the rest of the round
    # One device's batch is refused before its update is applied when its mean loss is
    # beyond max(chance level ln C, loss_factor x the median of its cut's recent batch
    # losses) (0: not checked). Honest batches measured up to 4.9x the median (label skew,
    # Dirichlet 0.1) and under ln C once the median is; label-flipped ones at 10-200x. Not
    # checked when devices release noised activations (privacy=activation_gaussian): noise
    # makes an honest device's loss as large as its own sigma makes it.
    loss_factor: float = 6.0
    # A batch beyond that bound is still taken when its loss is within label_factor x the
    # trunk's loss, at the same step, on the server's own held-out rows of the same labels
    # (0: never): label skew leaves an honest device's classes forgotten by a trunk that
    # trained on other devices' (Fashion-MNIST, Dirichlet 0.5: 4.27 beside a median of
    # 0.19), while flipped labels stay far beyond what their claimed classes' true rows give.
    label_factor: float = 3.0
    # A U-shaped device's returned gradient is refused when its distance from the nearest
    # gradient any labelling of its batch gives through the device's tail (which the server
    # replays: server/consistency.py) is beyond max(residual_floor, residual_factor x the
    # recent median), relative to its norm (residual_floor 0: not checked). On the default
    # job honest batches measured at most 3e-4, negated ones (gradient ascent) 0.82 to 1.2.
    # The labels found (when within residual_floor: under gradient noise they are guesses)
    # give the batch's loss, checked as above but never below
    # tail_loss_floor x ln C: that loss goes through the device's own tail, averaged over
    # skewed devices, and an honest batch under +scenario=heterogeneous measured 2.74 (above
    # ln C = 2.30) beside a recent median of 0.10; flipped labels measured 13-14.
    residual_floor: float = 0.25
    residual_factor: float = 4.0
    tail_loss_floor: float = 2.0

    def __post_init__(self) -> None:
        if not self.row_factor > 1:
            raise ValueError(f"dataplane.guard.row_factor={self.row_factor}: need > 1")
        if not self.seed_factor >= 1:
            raise ValueError(f"dataplane.guard.seed_factor={self.seed_factor}: need >= 1")
        if not self.update_clip >= 0:
            raise ValueError(f"dataplane.guard.update_clip={self.update_clip}: need >= 0")
        if not self.residual_floor >= 0:
            raise ValueError(f"dataplane.guard.residual_floor={self.residual_floor}: need >= 0 "
                             "(0: not checked)")
        if not self.residual_factor > 1:
            raise ValueError(f"dataplane.guard.residual_factor={self.residual_factor}: need > 1")
        if not self.tail_loss_floor >= 1:
            raise ValueError(f"dataplane.guard.tail_loss_floor={self.tail_loss_floor}: need >= 1")
        if not (self.label_factor == 0 or self.label_factor > 1):
            raise ValueError(f"dataplane.guard.label_factor={self.label_factor}: need 0 (off) "
                             "or > 1")
        if not (self.loss_factor == 0 or self.loss_factor > 1):
            raise ValueError(f"dataplane.guard.loss_factor={self.loss_factor}: need 0 (off) "
                             "or > 1")
        for key in ("min_rows", "window_rows", "min_steps", "window_steps", "strikes"):
            if getattr(self, key) < 1:
                raise ValueError(f"dataplane.guard.{key}={getattr(self, key)}: need >= 1")


#: ``server.precision`` values: float32 throughout, or the trunk's forward in bfloat16.
SERVER_PRECISIONS = ("fp32", "bf16")
#: ``server.device`` values, besides ``cuda:N`` (the N-th CUDA device).
SERVER_DEVICES = ("auto", "cpu", "cuda", "mps")


@dataclass
class ServerConfig:
    """Where the trunk computes, and in what precision (splitlearn/accelerators.py).

    ``device``: ``auto`` (CUDA, else MPS, else the CPU), ``cpu``, ``cuda``, ``cuda:N`` or
    ``mps``; a device this machine lacks is refused before the run starts. The trunk trains
    there; frames arrive and leave on the host. ``precision``: ``bf16`` runs the trunk's
    forward under autocast to bfloat16 (its weights, optimiser state and the gradient sent
    back stay float32).
    """

    device: str = "cpu"
    precision: str = "fp32"

    def __post_init__(self) -> None:
        index = self.device.removeprefix("cuda:")
        if self.device not in SERVER_DEVICES and not (
                self.device.startswith("cuda:") and index.isdigit()):
            raise ValueError(f"server.device={self.device!r}; accepted: "
                             f"{list(SERVER_DEVICES)} or cuda:N")
        if self.precision not in SERVER_PRECISIONS:
            raise ValueError(f"server.precision={self.precision!r}; accepted: "
                             f"{list(SERVER_PRECISIONS)}")


@dataclass
class DataPlaneConfig:
    """The trunk's gRPC service and what it accepts."""

    host: str = "127.0.0.1"  # bind address; 0.0.0.0 to accept remote devices
    port: int = 0  # 0 = any free port
    advertise_host: str | None = None  # what clients dial, if not `host`
    # Also serve the data plane over WebSocket (browsers cannot open gRPC streams) on this
    # port, on the same host, endpoint, tokens and TLS files; 0 = any free port, None = not
    # at all. Devices whose node config says trunk-transport="websocket" dial it.
    websocket_port: int | None = None
    max_frame_bytes: int = 64 * 1024 * 1024
    max_batch: int = 4096
    # Finite values beyond this are refused: near float32's limit they overflow the
    # first layer and would leave the trunk's weights NaN. Activations here are O(10).
    max_abs_value: float = 1.0e6
    max_streams: int = 64  # streams served at once; more are refused, never queued
    streams_per_token: int = 1  # one session, one stream: a stolen token cannot add more
    # A session (a device's token for a round) whose frames were refused this many times
    # loses its token and its streams (0: never). Honest devices measured none of the
    # counted kinds; a device flooding bad frames slowed an honest one 3-4x before.
    max_refusals: int = 32
    idle_timeout_s: float = 300.0  # a stream silent this long is closed
    reply_timeout_s: float = 600.0  # a client gives up on a reply after this long
    token_ttl_s: float = 3600.0  # a round's tokens also die when the round ends
    # Bind each token to a key its node gives the ServerApp over Flower (query.node_key):
    # a stream opens only with that node's signature, so another node cannot use it.
    # None: on under `flwr run` (a SuperLink: real devices may connect), off in the
    # in-process Simulation Engine of `experiments.run`, where every node is the run's own
    # and a key costs each newly sampled node one more Flower message.
    node_keys: bool | None = None
    trunk_threads: int = 1  # intra-op threads of the trunk's process (see engine)
    # Start each trunk step on the core the last one ended on, whichever data-plane thread
    # serves it (Linux; server/cores.py): steps hopping cores start with cold caches.
    # None: on with one trunk process, off with trunk_workers > 1 (measured no gain there).
    trunk_sticky_core: bool | None = None
    # The trunk's processes keep the memory their steps free for the next step, instead
    # of giving it back and faulting it in again (glibc; server/allocator.py).
    trunk_reuses_memory: bool = True
    # The trunk's 4-D activations channels-last; None: as the model prefers
    # (SplittableModel.channels_last, measured by `python -m benchmarks trunk`).
    channels_last: bool | None = None
    # SplitFed v2's trunk in this many processes, clients dealt to them in turn and the
    # copies merged every round (1: the trunk steps in the ServerApp's process).
    trunk_workers: int = 1
    # TLS on the trunk service (PEM files; the same ones the SuperLink takes). Devices
    # verify the trunk against ssl_ca_certfile, sent in the task over the Flower link,
    # or against their own roots (node config trunk-root-certificates).
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certfile: str | None = None
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self) -> None:
        if self.trunk_workers < 1:
            raise ValueError(f"dataplane.trunk_workers={self.trunk_workers}: need at least 1")
        if self.max_refusals < 0:
            raise ValueError(f"dataplane.max_refusals={self.max_refusals}: need >= 0 "
                             "(0: never closed)")
        if self.websocket_port is not None and not 0 <= self.websocket_port <= 65535:
            raise ValueError(f"dataplane.websocket_port={self.websocket_port}: a port is "
                             "0-65535 (0: any free one)")
        if self.websocket_port is not None and self.trunk_workers > 1:
            raise ValueError("dataplane.websocket_port serves the trunk of this process: it "
                             f"needs dataplane.trunk_workers=1 (got {self.trunk_workers})")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("dataplane.ssl_certfile and dataplane.ssl_keyfile go together "
                             f"(got {self.ssl_certfile!r} and {self.ssl_keyfile!r})")
        if self.ssl_ca_certfile is not None and self.ssl_certfile is None:
            raise ValueError("dataplane.ssl_ca_certfile needs dataplane.ssl_certfile and "
                             "dataplane.ssl_keyfile: the trunk serves TLS only with its own "
                             "certificate")
        for key in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certfile"):
            path = getattr(self, key)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"dataplane.{key}={path!r}: no such file")

    @property
    def tls(self) -> bool:
        """Whether the trunk service serves TLS."""
        return self.ssl_certfile is not None


@dataclass
class EngineConfig:
    """How the Flower clients are run."""

    name: str = "simulation"  # Flower Simulation Engine, in this process
    num_cpus_per_client: float = 1.0  # Ray resources per ClientApp
    # Intra-op threads per ClientApp and for the trunk: oversubscribing 2 cores with 2
    # threads each ran training ~12x slower than 1 thread each.
    torch_threads: int = 1
    ray_address: str | None = None  # attach to an existing Ray cluster


@dataclass
class LoggerConfig:
    """Where metrics go besides the run folder."""

    name: str = "wandb"  # wandb | none
    mode: str = "auto"  # auto (online with credentials, else offline) | online | offline
    project: str = "splitlearn"
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    plots: bool = True  # PNG plots in the run folder at the end (off: JSON/CSV only)


#: ``privacy.name`` values (splitlearn.privacy.registry implements each).
PRIVACY_NAMES = ("none", "activation_gaussian", "dpsgd_client")


@dataclass
class DevicePrivacyConfig:
    """One device class's own privacy in a mixed fleet (``privacy.per_device.<profile>``)."""

    noise_multiplier: float | None = None  # this class's sigma; None = the run's
    epsilon_max: float | None = None  # this class's budget; None = the run's


@dataclass
class PrivacyConfig:
    """Privacy of what leaves a client (docs/how-to/privacy.md says what epsilon covers)."""

    name: str = "none"  # none | activation_gaussian | dpsgd_client
    clip_norm: float = 1.0  # C: per-sample L2 bound (activation rows or gradients)
    noise_multiplier: float = 0.0  # sigma: noise std = sigma * C; > 0 unless name=none
    delta: float = 1e-5  # below 1/n for the ~150 examples a digits client holds
    epsilon_max: float | None = None  # per-client budget; None = train every round
    # NoPeek: the device also minimises this x dCor(inputs, what it sends), batch by batch
    # (split protocols); a defence against inversion, not a DP guarantee. 0 = off.
    nopeek_weight: float = 0.0
    # Label DP: each device trains on its labels after K-ary randomised response at this
    # epsilon, drawn once per example from a secret the node keeps. None = off.
    label_epsilon: float | None = None
    # U-shaped: the gradient the device returns at the trunk's features, each example's row
    # clipped to gradient_clip_norm and noised with std gradient_noise_multiplier x that
    # clip (isotropic, a Marvell-style defence of the labels). 0 = off.
    gradient_noise_multiplier: float = 0.0
    gradient_clip_norm: float = 1.0
    # A mixed fleet: device preset -> its own sigma and budget (accounted options only), e.g.
    # '+privacy.per_device={wearable: {epsilon_max: 2}}'; other presets use the settings above.
    per_device: dict[str, DevicePrivacyConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in PRIVACY_NAMES:
            raise ValueError(f"privacy.name={self.name!r}; accepted: {list(PRIVACY_NAMES)}")
        if not self.nopeek_weight >= 0:
            raise ValueError(f"privacy.nopeek_weight must be >= 0, got {self.nopeek_weight!r}")
        if not (math.isfinite(self.gradient_noise_multiplier)
                and self.gradient_noise_multiplier >= 0):
            raise ValueError("privacy.gradient_noise_multiplier must be a finite number >= 0, "
                             f"got {self.gradient_noise_multiplier!r}")
        if not (math.isfinite(self.gradient_clip_norm) and self.gradient_clip_norm > 0):
            raise ValueError("privacy.gradient_clip_norm must be a finite number > 0, got "
                             f"{self.gradient_clip_norm!r}")
        if self.label_epsilon is not None and not (
                math.isfinite(self.label_epsilon) and self.label_epsilon > 0):
            raise ValueError(f"privacy.label_epsilon must be a finite number > 0 or null, got "
                             f"{self.label_epsilon!r}")
        if self.name == "none":
            if self.per_device:
                raise ValueError(f"privacy.per_device={sorted(self.per_device)} sets noise and "
                                 "budgets of an accounted option; privacy=none has neither")
            return
        if not self.clip_norm > 0:
            raise ValueError(f"privacy.clip_norm must be > 0, got {self.clip_norm!r}")
        if not self.noise_multiplier > 0:
            raise ValueError(
                f"privacy.noise_multiplier must be > 0 for privacy={self.name}, got "
                f"{self.noise_multiplier!r} (use privacy=none for no noise)"
            )
        if not 0 < self.delta < 1:
            raise ValueError(f"privacy.delta must be in (0, 1), got {self.delta!r}")
        if self.epsilon_max is not None and not self.epsilon_max > 0:
            raise ValueError(f"privacy.epsilon_max must be > 0 or null, got {self.epsilon_max!r}")
        for device, own in self.per_device.items():
            for key in ("noise_multiplier", "epsilon_max"):
                value = getattr(own, key)
                if value is not None and not (math.isfinite(value) and value > 0):
                    raise ValueError(f"privacy.per_device.{device}.{key} must be a finite "
                                     f"number > 0 or null, got {value!r}")

    def for_device(self, profile: str | None) -> PrivacyConfig:
        """Return the settings a device of preset ``profile`` applies (its own, else the run's)."""
        own = self.per_device.get(profile or "")
        if own is None:
            return self
        return dataclasses.replace(
            self, per_device={},
            noise_multiplier=own.noise_multiplier or self.noise_multiplier,
            epsilon_max=own.epsilon_max if own.epsilon_max is not None else self.epsilon_max)

    @property
    def accounted(self) -> bool:
        """Whether this option spends privacy budget (everything but ``none``)."""
        return self.name != "none"


#: How the devices' copies of a stage may be aggregated (``aggregation.robust``): the
#: weighted mean, or Flower's FedMedian, FedTrimmedAvg, Krum, MultiKrum and Bulyan.
ROBUST_METHODS = ("none", "median", "trimmed_mean", "krum", "multi_krum", "bulyan")


@dataclass
class AggregationConfig:
    """What the server learns of the client-side weights it averages, and how it averages them.

    ``secure`` runs Flower's SecAgg+ on every training round (``secaggplus_mod`` on the
    ClientApp, ``SecAggPlusWorkflow``'s four stages from the ServerApp): each device masks
    its update, so the server learns the round's average and never one device's weights.
    ``update_clip_norm`` > 0 is DP-FedAvg with client-side clipping (Flower's
    ``DifferentialPrivacyClientSideFixedClipping``): each device bounds the L2 norm of its
    update before it leaves, the average is uniform over devices, and the server adds
    Gaussian noise of std ``update_noise_multiplier`` x clip / devices to it.
    ``robust`` replaces the weighted mean of the devices' copies of each stage by a
    statistic that a few poisoned copies cannot drag far (``splitlearn/robust.py``); it
    reads every device's arrays, so it excludes ``secure``. ``max_examples_ratio`` bounds
    the ``num-examples`` each device claims, which weighs its copy in every mean.
    """

    secure: bool = False
    # SecAgg+ shares per device: a count (an integer >= 3) or, <= 1, a fraction of the round's
    # devices (1.0: every device shares with every other, plain SecAgg).
    num_shares: float = 1.0
    # Shares that unmask a device: a count (integer >= 2, below num_shares) or, <= 1, a
    # fraction of num_shares. Devices beyond the threshold may drop out mid-round.
    reconstruction_threshold: float = 0.67
    # Each device quantises (update x its weight share) in [-clipping_range, clipping_range]:
    # a device whose update leaves the range refuses to mask it (it would be clipped).
    clipping_range: float = 1.0
    max_weight: float = 10000.0  # weights are examples / max_weight: at least the largest share
    quantization_range: int = 4194304  # levels per coordinate (2^22, Flower's default)
    update_clip_norm: float = 0.0  # DP-FedAvg: L2 bound of a device's update; 0 = off
    update_noise_multiplier: float = 0.0  # sigma on the sum of clipped updates; 0 = clip only
    update_delta: float = 1e-5  # the delta update-epsilon is reported at
    # Robust aggregation of the device side, per stage over the devices' copies of it:
    # none (the mean weighted by examples) | median | trimmed_mean | krum | multi_krum |
    # bulyan (Flower's FedMedian, FedTrimmedAvg, Krum, MultiKrum, Bulyan). Needs each
    # device's own arrays: not with secure=true, nor with DP-FedAvg's noise.
    robust: str = "none"
    # f, the devices assumed Byzantine (Flower's num_malicious_nodes): sets Krum's
    # neighbours and Bulyan's selection, and the fewest copies a method needs (median 2f+1,
    # trimmed_mean int(trim_fraction x n) >= max(f, 1), krum and multi_krum 2f+3, bulyan
    # 4f+3). A round's stage with fewer copies keeps its previous weights.
    num_malicious: int = 1
    # trimmed_mean: share of the copies cut off at each end of every coordinate (Flower's beta)
    trim_fraction: float = 0.2
    multi_krum_selected: int = 0  # multi_krum: the best-scored copies averaged (m); 0 = n - f
    # A device's claimed num-examples weighs at most this x the round's median claim (the
    # lower median of the finished devices); 0 = unbounded. Not under secure=true: there
    # each device applies its own weight before masking (max_weight).
    max_examples_ratio: float = 10.0
    # Each device's update of a module (a layer), its trained arrays minus what it was
    # given, is shortened to this x the round's (lower) median update of that module over
    # the devices holding it; 0 = unbounded. Not under secure=true (the server sees only
    # the sum). Stops scaled and negated device weights from 1 and 2 devices of 10 with the
    # weighted mean; it shortened 2-5 of 200 honest device-rounds in the default job and
    # 2-7 of 200 under +scenario=heterogeneous, at the final accuracy of runs without it.
    max_update_ratio: float = 4.0

    def __post_init__(self) -> None:
        for key in ("num_shares", "reconstruction_threshold", "clipping_range", "max_weight"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"aggregation.{key} must be a finite number > 0, got {value!r}")
        for key in ("num_shares", "reconstruction_threshold"):
            value = getattr(self, key)
            if value > 1 and not float(value).is_integer():
                raise ValueError(f"aggregation.{key}={value!r}: a count must be an integer "
                                 "(or give a fraction <= 1)")
        if 1 < self.num_shares < 3:
            raise ValueError(f"aggregation.num_shares={self.num_shares!r}: a count must be >= 3 "
                             "(or give a fraction <= 1)")
        if 1 < self.reconstruction_threshold and 1 < self.num_shares <= \
                self.reconstruction_threshold:
            raise ValueError("aggregation.reconstruction_threshold="
                             f"{self.reconstruction_threshold!r} must be below "
                             f"aggregation.num_shares={self.num_shares!r}")
        if self.quantization_range < 2:
            raise ValueError("aggregation.quantization_range must be >= 2, got "
                             f"{self.quantization_range!r}")
        for key in ("update_clip_norm", "update_noise_multiplier"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"aggregation.{key} must be a finite number >= 0, got {value!r}")
        if self.update_noise_multiplier and not self.update_clip_norm:
            raise ValueError(f"aggregation.update_noise_multiplier={self.update_noise_multiplier}"
                             " needs aggregation.update_clip_norm > 0 (noise without a bound "
                             "protects nothing)")
        if not 0 < self.update_delta < 1:
            raise ValueError(f"aggregation.update_delta must be in (0, 1), got "
                             f"{self.update_delta!r}")
        if self.robust not in ROBUST_METHODS:
            raise ValueError(f"aggregation.robust={self.robust!r}: expected one of "
                             f"{list(ROBUST_METHODS)}")
        for key in ("num_malicious", "multi_krum_selected"):
            if getattr(self, key) < 0:
                raise ValueError(f"aggregation.{key} must be >= 0, got {getattr(self, key)!r}")
        if not 0 < self.trim_fraction < 0.5:
            raise ValueError(f"aggregation.trim_fraction must be in (0, 0.5), got "
                             f"{self.trim_fraction!r}")
        if not (self.max_examples_ratio == 0 or (math.isfinite(self.max_examples_ratio)
                                                 and self.max_examples_ratio >= 1)):
            raise ValueError("aggregation.max_examples_ratio must be 0 (unbounded) or a finite "
                             f"number >= 1, got {self.max_examples_ratio!r}")
        if not (self.max_update_ratio == 0 or (math.isfinite(self.max_update_ratio)
                                               and self.max_update_ratio >= 1)):
            raise ValueError("aggregation.max_update_ratio must be 0 (unbounded) or a finite "
                             f"number >= 1, got {self.max_update_ratio!r}")
        if self.robust != "none" and self.secure:
            raise ValueError(
                f"aggregation.robust={self.robust} needs each device's own arrays; "
                "aggregation.secure=true lets the server see only their sum (SecAgg+): choose "
                "one of them")
        if self.robust != "none" and self.update_noise_multiplier:
            raise ValueError(
                f"aggregation.robust={self.robust} with aggregation.update_noise_multiplier="
                f"{self.update_noise_multiplier}: DP-FedAvg's noise is calibrated to the mean "
                "of clipped updates, which one device moves by at most clip / n; a robust "
                "statistic can move by a whole update (Krum picks one), so the reported "
                "update-epsilon would not hold (clipping alone, noise 0, is accepted)")

    @property
    def clipped(self) -> bool:
        """Whether devices clip their updates (DP-FedAvg)."""
        return self.update_clip_norm > 0


@dataclass
class FailuresConfig:
    """Client failures on top of what the device profiles imply."""

    dropout_rate: float = 0.0  # extra chance that a started client vanishes mid-round
    dropout_after_steps: int = 2  # a dropping client vanishes after this many batches
    round_deadline_s: float | None = None  # virtual s; later clients count as stragglers


@dataclass
class DeviceProfileConfig:
    """One device preset (see splitlearn/planning/devices.py:DeviceProfile)."""

    flops_per_s: float = MISSING  # sustained training FLOP/s, not peak
    memory_bytes: int = MISSING  # what the training app may use
    uplink_mbps: float = MISSING
    downlink_mbps: float = MISSING
    rtt_s: float = MISSING
    availability: float = 1.0  # chance of being reachable when sampled
    dropout: float = 0.0  # chance of vanishing mid-round


@dataclass
class TraceEventConfig:
    """From a round on, some devices change (splitlearn/planning/devices.py:apply_traces)."""

    from_round: int = MISSING  # the first round the change holds
    profiles: list[str] = field(default_factory=list)  # devices of these presets ...
    partitions: list[int] = field(default_factory=list)  # ... and/or these clients
    flops_scale: float = 1.0  # e.g. 0.4: a phone that throttles
    memory_scale: float = 1.0  # e.g. 0.25: another app takes memory
    uplink_mbps: float | None = None  # a new link (Wi-Fi -> cellular), None = unchanged
    downlink_mbps: float | None = None
    rtt_s: float | None = None


#: ``devices.runtime`` values: what trains a device's stages.
CLIENT_RUNTIMES = ("eager", "executorch")


@dataclass
class DevicesConfig:
    """Which devices the clients emulate."""

    name: str = "none"  # none: every client runs at this host's speed, links are free
    mix: dict[str, float] = field(default_factory=dict)  # profile -> share of clients
    profiles: dict[str, DeviceProfileConfig] = field(default_factory=dict)
    traces: list[TraceEventConfig] = field(default_factory=list)  # changes over rounds
    emulate: bool = False  # really wait as long as the device would (wall-clock runs)
    # What an emulated device's compute costs on the virtual clock: the FLOPs its training
    # step executes (counted on its first batch of a round) over its FLOP/s (flops), or
    # the seconds this host took, rescaled by host over device FLOP/s (measured: that
    # carries the host's load and its per-batch overhead into the device's time).
    compute_time: str = "flops"
    host_flops_per_s: float | None = None  # this host's training FLOP/s; None = measure
    # The same per cut (the host is faster on some stages than others); a planner's run
    # measures every cut unless host_flops_per_s is set. Empty: host_flops_per_s for all.
    host_flops_by_cut: dict[int, float] = field(default_factory=dict)
    # What runs the device's stages: eager PyTorch, or the exported ExecuTorch program
    # through ExecuTorch's runtime (clients/steps/executorch.py; split protocols only).
    runtime: str = "eager"
    # Phones may join through the gateway (python -m clients.gateway) and train in the web
    # runtime (web/: TensorFlow.js in the browser): every cut in play is checked against
    # what that runtime runs, and the run is refused before it starts, naming the layer.
    web: bool = False

    def __post_init__(self) -> None:
        if self.compute_time not in COMPUTE_TIMES:
            raise ValueError(f"devices.compute_time={self.compute_time!r}; accepted: "
                             f"{list(COMPUTE_TIMES)}")
        if self.runtime not in CLIENT_RUNTIMES:
            raise ValueError(f"devices.runtime={self.runtime!r}; accepted: {list(CLIENT_RUNTIMES)}")

    def host_flops_at(self, cut: int) -> float:
        """Return the host's training FLOP/s on the client side at ``cut`` (0: unknown)."""
        return self.host_flops_by_cut.get(cut) or self.host_flops_per_s or 0.0


#: ``devices.compute_time`` values: how the virtual clock charges an emulated device's compute.
COMPUTE_TIMES = ("flops", "measured")


#: ``planner.name`` values (splitlearn.planning.planners implements each but ``uniform``).
PLANNER_NAMES = ("uniform", "greedy", "dynsl", "smartsplit", "oracle", "rotate")


@dataclass
class PlannerConfig:
    """Where each client is cut, round by round (docs/how-to/adaptive-splits.md)."""

    name: str = "uniform"  # uniform: every client at model.cut, as configured
    cuts: list[int] | None = None  # cuts a planner may give; None = every valid cut
    every: int = 1  # dynsl: re-plan every R rounds
    hysteresis: float = 0.05  # dynsl: a move must gain (1 + h) x its cost, and h x the round
    # dynsl: rounds to the target with every device at the deepest cut over those at the
    # shallowest, minus 1; a plan's round counts 1 + this x its depth (0: the round alone)
    learning_penalty: float = 0.4
    # dynsl: where a device not measured yet trains, with the measured devices' deadline:
    # at the cut planned for the prior's guess of it (planned), or at its smallest cut
    start: str = "planned"
    select_fraction: float = 1.0  # smartsplit: share of the clients that train per round
    # smartsplit: if set, the fewest; each round the size in between with the most utility
    # per predicted second trains (None: always select_fraction)
    min_select_fraction: float | None = None
    # smartsplit: if set, partial work: each round gets a deadline, and a selected device
    # trains the batches that end by it, at least this share of its round (None: all)
    min_work: float | None = None
    exploration: float = 0.1  # smartsplit: weight of the staleness bonus (Oort's 0.1)
    straggler_penalty: float = 2.0  # smartsplit: exponent of the slow-device penalty (Oort's 2)
    selection: str = "utility"  # smartsplit: utility | random (the baseline among feasible ones)
    recompute: bool = True  # planners may ask a device to recompute activations to save memory
    smoothing: float = 0.5  # weight of the newest measurement in the running estimates
    max_leak: float | None = None  # privacy floor: never a cut whose leak score exceeds this
    # A device not measured yet is planned as a median phone: a mid-range phone's sustained
    # FLOP/s (conf/devices/profiles/presets.yaml) on the Ookla global mobile median link.
    prior_flops_per_s: float = 1.5e10
    prior_uplink_mbps: float = 10.0
    prior_downlink_mbps: float = 50.0
    prior_rtt_s: float = 0.04
    leak: dict[int, float] = field(default_factory=dict)  # measured attack score per cut

    def __post_init__(self) -> None:
        if self.name not in PLANNER_NAMES:
            raise ValueError(f"planner.name={self.name!r}; accepted: {list(PLANNER_NAMES)}")
        if self.every < 1:
            raise ValueError(f"planner.every must be >= 1, got {self.every}")
        if not 0 < self.select_fraction <= 1:
            raise ValueError(
                f"planner.select_fraction must be in (0, 1], got {self.select_fraction}"
            )
        if self.min_select_fraction is not None and not (
                0 < self.min_select_fraction <= self.select_fraction):
            raise ValueError(f"planner.min_select_fraction must be in (0, select_fraction="
                             f"{self.select_fraction}], got {self.min_select_fraction}")
        if self.min_work is not None and not 0 < self.min_work <= 1:
            raise ValueError(f"planner.min_work must be in (0, 1], got {self.min_work}")
        if self.start not in ("planned", "smallest"):
            raise ValueError(f"planner.start={self.start!r}; accepted: planned, smallest")
        if self.selection not in ("utility", "random"):
            raise ValueError(f"planner.selection={self.selection!r}; accepted: utility, random")
        for key in ("exploration", "straggler_penalty"):
            if getattr(self, key) < 0:
                raise ValueError(f"planner.{key} must be >= 0, got {getattr(self, key)}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"planner.smoothing must be in (0, 1], got {self.smoothing}")
        if not 0 <= self.learning_penalty < math.inf:
            raise ValueError(
                f"planner.learning_penalty must be finite and >= 0, got {self.learning_penalty}")

    @property
    def adaptive(self) -> bool:
        """Whether cuts are planned per client (anything but ``uniform``)."""
        return self.name != "uniform"


@dataclass
class Config:
    """A whole experiment."""

    seed: int = 0
    num_clients: int = 10
    run_dir: str = MISSING  # set by Hydra to its output dir
    checkpoint: bool = True  # write run_dir/checkpoint.pt after every round
    resume: bool = False  # continue the run in run_dir from its checkpoint
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    partitioner: PartitionerConfig = field(default_factory=PartitionerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    dataplane: DataPlaneConfig = field(default_factory=DataPlaneConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    failures: FailuresConfig = field(default_factory=FailuresConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)


@dataclass
class RunSpec:
    """What a client needs of the run, sent beside every round's data.

    The same dataclasses as the config, so a setting has one representation on
    both sides. ``devices.host_flops_per_s`` arrives resolved (measured on the
    server when the config left it empty).
    """

    seed: int = 0
    torch_threads: int = 1
    max_frame_bytes: int = 64 * 1024 * 1024
    reply_timeout_s: float = 600.0
    trunk_tls: bool = False  # the trunk service serves TLS
    trunk_root_certificates: str = ""  # PEM to verify it by ("" with TLS: system roots)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    partitioner: PartitionerConfig = field(default_factory=PartitionerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    failures: FailuresConfig = field(default_factory=FailuresConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)


def run_spec(cfg: DictConfig, *, host_flops_per_s: float) -> RunSpec:
    """Return the client's part of a composed config, as typed objects."""
    spec = RunSpec(
        seed=cfg.seed, torch_threads=cfg.engine.torch_threads,
        max_frame_bytes=cfg.dataplane.max_frame_bytes,
        reply_timeout_s=cfg.dataplane.reply_timeout_s,
        trunk_tls=cfg.dataplane.ssl_certfile is not None,
        trunk_root_certificates=(Path(cfg.dataplane.ssl_ca_certfile).read_text()
                                 if cfg.dataplane.ssl_ca_certfile else ""),
        compression=to_object(cfg.dataplane.compression),
        **{k: to_object(cfg[k]) for k in (
            "dataset", "partitioner", "model", "strategy", "privacy", "failures", "devices")},
    )
    spec.devices.host_flops_per_s = host_flops_per_s
    return spec


def encode_spec(spec: RunSpec) -> str:
    """Serialise a spec (YAML: nested, typed values and nulls survive the trip)."""
    return OmegaConf.to_yaml(OmegaConf.structured(spec))


def decode_spec(text: str, *, strategy: type[StrategyConfig]) -> RunSpec:
    """Rebuild a spec; OmegaConf checks every key and type against the schemas.

    Parameters
    ----------
    text : str
        What :func:`encode_spec` wrote.
    strategy : type[StrategyConfig]
        The protocol's options schema (the message type says which protocol).

    Raises
    ------
    ValueError
        Naming the offending key: unknown or mistyped (OmegaConf's errors, re-raised).
    """
    try:
        return copy.deepcopy(_decode(text, strategy))  # a private copy: callers may change it
    except OmegaConfBaseException as err:  # an unknown key is a KeyError: one type for callers
        raise ValueError(f"run spec refused: {err}") from err


@functools.lru_cache(maxsize=4)
def _decode(text: str, strategy: type[StrategyConfig]) -> RunSpec:
    # A memo of a pure function: every message of a run carries the same spec, and
    # OmegaConf's validation costs ~13 ms, a tenth of a small client's round.
    schema = OmegaConf.structured(RunSpec(strategy=strategy()))
    return OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.create(text)))  # type: ignore[return-value]


def to_object(node: Any) -> Any:
    """Return a config node as its dataclass instance (``__post_init__`` checks run)."""
    return OmegaConf.to_object(node) if isinstance(node, DictConfig) else node


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """Resolve a config into plain Python containers."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]



#: Keys that were renamed, old full key to new: a run that still sets an old one is
#: refused naming the new one, rather than told only that the old one does not exist.
RENAMED_KEYS = {
    # Read as the run's checkpoints (``checkpoint``, ``resume``); it is activation recomputation.
    "planner.checkpointing": "planner.recompute",
}


def check_keys(cfg: DictConfig) -> None:
    """Refuse a key no schema has, including one added with Hydra's ``+`` (ValueError).

    Hydra lets ``+key=value`` through the schemas' struct mode, so a misspelt
    ``+strategy.num_round=1`` would be written to the run's config and used by nothing.
    Every node typed by a dataclass accepts its fields only; a mapping typed
    ``dict[str, Any]`` (``model.options``, a user model's own arguments) is open.

    Raises
    ------
    ValueError
        Naming the full key and the nearest valid one, or the new name of a
        renamed key (:data:`RENAMED_KEYS`).
    """
    _check_node_keys(cfg, "")


def check_overrides(overrides: Iterable[str]) -> None:
    """Refuse a Hydra override that sets a renamed key (ValueError naming the new one).

    Hydra itself refuses ``planner.checkpointing=false`` (no ``+``), before
    :func:`check_keys` sees the config, with a message that cannot name the new key;
    this runs before Hydra composes. Overrides with ``+`` reach :func:`check_keys` too.

    Raises
    ------
    ValueError
        Naming the old key and the new one.
    """
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("~+")
        if key in RENAMED_KEYS:
            raise ValueError(_renamed_message(key))


def _renamed_message(key: str) -> str:
    return f"config key {key!r} was renamed to {RENAMED_KEYS[key]!r}; set that instead"


def _check_node_keys(node: DictConfig, prefix: str) -> None:
    schema = OmegaConf.get_type(node)
    known = ({f.name for f in dataclasses.fields(schema)}
             if dataclasses.is_dataclass(schema) else None)
    for key in node.keys():
        name = f"{prefix}{key}"
        if known is not None and key not in known:
            if name in RENAMED_KEYS:
                raise ValueError(_renamed_message(name))
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            raise ValueError(f"unknown config key {name!r}: no schema has it{hint} "
                             f"(keys of {prefix.rstrip('.') or 'the config'}: {sorted(known)})")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _check_node_keys(child, f"{name}.")
