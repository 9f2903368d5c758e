"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore.

``conf/config.yaml`` extends :class:`Config` (registered as ``base_config``),
so a misspelt key or a value of the wrong type fails when Hydra composes the
config, with the key's full name in the message. Scenarios in
``conf/scenario/`` are ``# @package _global_`` files selected with
``+scenario=NAME``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

#: Where the shipped YAML lives (travels with the source tree and the Flower FAB).
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


@dataclass
class DatasetConfig:
    """Which data to train on."""

    name: str = "digits"  # scikit-learn's digits ship with the package: works offline
    path: str | None = None  # local folder for flwr-datasets datasets (no download)
    test_fraction: float = 0.2  # digits only: held-out share, stratified
    image_size: int | None = None  # resize (bilinear) to this size; None = native


@dataclass
class PartitionerConfig:
    """How the training data is split over clients (flwr-datasets partitioners)."""

    name: str = "iid"  # iid | dirichlet | shards
    alpha: float = 0.5  # Dirichlet concentration; smaller = more label skew
    shards_per_partition: int = 2  # pathological shards: classes per client, roughly


@dataclass
class ModelConfig:
    """The splittable network and where it is cut."""

    name: str = "cnn"  # cnn | resnet | a zoo network (splitlearn/models: MODELS, ZOO)
    cut: int = 1  # stages [0, cut) run on the client
    # strategy=ushaped only: the client also keeps stages [tail_cut, num_stages) and the
    # loss, so labels stay on the device; 0 = the last stage only. cut < tail_cut.
    tail_cut: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # model-specific keywords


@dataclass
class StrategyConfig:
    """The training protocol and its optimisation settings."""

    name: str = "splitfed_v2"  # see conf/strategy/ for the protocols
    num_rounds: int = 20
    fraction_train: float = 1.0  # share of connected clients sampled per round
    min_train_nodes: int = 2
    fraction_evaluate: float = 0.0  # federated evaluation; centralised eval runs anyway
    local_epochs: int = 2  # with 1, parallel clients need ~12 rounds to reach 97% on digits
    batch_size: int = 32
    lr: float = 0.05  # plain SGD on both sides, same lr: split == whole-model SGD
    momentum: float = 0.5  # 0.9 on the shared trunk stalls training under label skew
    weight_decay: float = 0.0
    round_timeout_s: float = 600.0  # Flower waits this long for replies
    batch_concurrent: bool = False  # splitfed_v2: one trunk step over concurrent clients
    barrier_timeout_s: float = 0.05  # longest a batch waits for the other clients' batches
    # local_loss only:
    bulk: bool = False  # ship a round's smashed data in the Flower reply (no data plane)
    aux_hidden: int = 0  # auxiliary head: 0 = one linear layer, else an MLP this wide
    queue_batches: int = 256  # smashed batches the trunk may hold before back-pressure


@dataclass
class DataPlaneConfig:
    """The trunk's gRPC service."""

    host: str = "127.0.0.1"  # bind address; 0.0.0.0 to accept remote devices
    port: int = 0  # 0 = any free port
    advertise_host: str | None = None  # what clients dial, if not `host`
    max_frame_bytes: int = 64 * 1024 * 1024
    max_batch: int = 4096
    token_ttl_s: float = 3600.0  # a round's tokens also die when the round ends
    # Intra-op threads of the trunk's process. Measured on the 2-core dev VM:
    # ResNet fwd+bwd at 32x32 ran 510 samples/s on 1 thread and 35-40 on 2.
    trunk_threads: int = 1


@dataclass
class EngineConfig:
    """How the Flower clients are run."""

    name: str = "simulation"  # Flower Simulation Engine, in this process
    num_cpus_per_client: float = 1.0  # Ray resources per ClientApp
    torch_threads: int = 1  # per ClientApp: oversubscribing 2 cores slows everyone
    ray_address: str | None = None  # attach to an existing Ray cluster


@dataclass
class LoggerConfig:
    """Where metrics go besides the run folder."""

    name: str = "wandb"  # wandb | none
    mode: str = "auto"  # auto (online with credentials, else offline) | online | offline
    project: str = "splitlearn"
    group: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class PrivacyConfig:
    """Privacy of what leaves a client (README "Privacy" says what epsilon covers)."""

    name: str = "none"  # none | activation_gaussian | dpsgd_client
    clip_norm: float = 1.0  # C: per-sample L2 bound (activation rows or gradients)
    noise_multiplier: float = 0.0  # sigma: noise std = sigma * C; > 0 unless name=none
    delta: float = 1e-5  # below 1/n for the ~150 examples a digits client holds
    epsilon_max: float | None = None  # per-client budget; None = train every round


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
class DevicesConfig:
    """Which devices the clients emulate."""

    name: str = "none"  # none: every client runs at this host's speed, links are free
    mix: dict[str, float] = field(default_factory=dict)  # profile -> share of clients
    profiles: dict[str, DeviceProfileConfig] = field(default_factory=dict)
    emulate: bool = False  # really wait as long as the device would (wall-clock runs)
    host_flops_per_s: float | None = None  # this host's training FLOP/s; None = measure


@dataclass
class Config:
    """A whole experiment."""

    seed: int = 0
    num_clients: int = 10
    scenario: str = "default"
    run_dir: str = MISSING  # set by Hydra to its output dir
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    partitioner: PartitionerConfig = field(default_factory=PartitionerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    dataplane: DataPlaneConfig = field(default_factory=DataPlaneConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    failures: FailuresConfig = field(default_factory=FailuresConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    # One schema for the whole tree: group files merge into typed nodes, so
    # they are validated without a schema of their own.
    cs.store(name="base_config", node=Config)


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """Compose ``conf/config.yaml`` with Hydra overrides, outside ``@hydra.main``.

    Used by the ServerApp under ``flwr run`` and by tests.

    Parameters
    ----------
    overrides : list[str], optional
        Hydra overrides such as ``["+scenario=heterogeneous", "strategy.num_rounds=3"]``.

    Returns
    -------
    DictConfig
        The composed config; ``run_dir`` is left for the caller to set.
    """
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides or []))


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """Resolve a config into plain Python containers."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
