"""The protocol registry: each protocol's parts and options, registered once.

A protocol is a name with four parts:

* ``options``: its typed sub-schema of ``strategy`` (a :class:`StrategyConfig`
  subclass; ``conf/strategy/NAME.yaml`` extends it as ``NAME_schema``);
* ``strategy``: its Flower strategy (a :class:`ReportingFedAvg`, usually
  :class:`SplitFed` plus small overrides);
* ``client``: its client step, which the one client loop calls per batch;
* ``trunk``: a factory of its trunk-side session handler, chosen by the protocol
  named in each session grant (None for a protocol without a data plane).

Message types are ``train.NAME`` and ``evaluate.NAME``. Adding a protocol means
writing its parts, its yaml and one line in :data:`PROTOCOLS`
(docs/adding-a-protocol.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from clients.steps.base import ClientStep
from clients.steps.local_loss import LocalLossStep
from clients.steps.split import SplitStep
from clients.steps.ushaped import UShapedStep
from clients.steps.whole import WholeModelStep
from server.sessions.sglr import sglr_sessions
from server.sessions.smashed import local_loss_sessions
from server.sessions.split import per_client_sessions, shared_sessions, splitfed_v2_sessions
from server.sessions.ushaped import ushaped_sessions
from server.trunk import Trunk
from splitlearn.config import CONF_DIR, Config, DataPlaneConfig, StrategyConfig, run_spec, to_object
from splitlearn.dataplane import SessionHandler
from splitlearn.models import SplittableModel
from strategies.local_loss import LocalLossOptions, LocalLossSplit
from strategies.reporting import FedAvgOptions, ReportingFedAvg
from strategies.sequential import SequentialOptions, SequentialSplit
from strategies.sglr import SGLROptions
from strategies.splitfed import SplitFed, SplitFedV1Options, SplitFedV2Options
from strategies.ushaped import UShapedOptions

#: Builds a protocol's session handler on the trunk from its options and the limits.
TrunkFactory = Callable[[Trunk, StrategyConfig, DataPlaneConfig], SessionHandler]


@dataclass(frozen=True)
class Protocol:
    """One protocol's parts (see the module docstring)."""

    name: str
    options: type[StrategyConfig]
    strategy: type[ReportingFedAvg]
    client: type[ClientStep]
    trunk: TrunkFactory | None
    #: Whether clients of one round may hold different cuts (``planner=`` other than uniform).
    per_client_cuts: bool = False


PROTOCOLS: dict[str, Protocol] = {p.name: p for p in (
    Protocol("fedavg", FedAvgOptions, ReportingFedAvg, WholeModelStep, None),
    Protocol("splitfed_v2", SplitFedV2Options, SplitFed, SplitStep, splitfed_v2_sessions,
             per_client_cuts=True),
    Protocol("splitfed_v1", SplitFedV1Options, SplitFed, SplitStep, per_client_sessions,
             per_client_cuts=True),
    Protocol("sequential", SequentialOptions, SequentialSplit, SplitStep, shared_sessions,
             per_client_cuts=True),
    Protocol("ushaped", UShapedOptions, SplitFed, UShapedStep, ushaped_sessions,
             per_client_cuts=True),
    Protocol("local_loss", LocalLossOptions, LocalLossSplit, LocalLossStep, local_loss_sessions,
             per_client_cuts=True),
    Protocol("sglr", SGLROptions, SplitFed, SplitStep, sglr_sessions, per_client_cuts=True),
)}


def protocol_named(name: str) -> Protocol:
    """Return the registered protocol ``name`` (ValueError naming the accepted ones)."""
    if name not in PROTOCOLS:
        raise ValueError(f"strategy.name={name!r}; accepted: {sorted(PROTOCOLS)}")
    return PROTOCOLS[name]


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore: the whole config and each protocol's."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    if "base_config.yaml" in store.list("/"):  # already registered in this process
        return
    store.store(name="base_config", node=Config)
    for protocol in PROTOCOLS.values():
        store.store(group="strategy", name=f"{protocol.name}_schema", node=protocol.options)


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """Compose ``conf/config.yaml`` with Hydra overrides, outside ``@hydra.main``.

    Used by the ServerApp under ``flwr run``, the benchmarks and the tests;
    ``run_dir`` is left for the caller to set.
    """
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides or []))


def check_config(cfg: DictConfig) -> None:
    """Refuse, before anything starts, a config that could only fail later.

    Checks the protocol (registered, and the schema its options were composed
    with), every ``__post_init__`` rule (privacy), the model, its cut and what
    the protocol's client step needs of it, the dataset and its folder, the
    device fleet, and that enough clients exist for a round.

    Raises
    ------
    ValueError
        Naming the offending key and what is accepted.
    """
    from splitlearn.data import check_dataset_config
    from splitlearn.models.factory import build_model_from_config
    from splitlearn.planning.devices import build_fleet

    protocol = protocol_named(cfg.strategy.name)
    if OmegaConf.get_type(cfg.strategy) is not protocol.options:
        raise ValueError(
            f"strategy.name={cfg.strategy.name!r} but the options were composed for "
            f"{OmegaConf.get_type(cfg.strategy).__name__}; select a protocol with strategy=NAME"
        )
    probe = cfg.copy()
    if OmegaConf.is_missing(probe, "run_dir"):  # the run folder is the caller's, not checked here
        probe.run_dir = "."
    config: Config = to_object(probe)  # runs every __post_init__ check
    check_dataset_config(config.dataset)
    if config.dataset.name == "synthetic" and config.partitioner.name != "iid":
        raise ValueError(f"partitioner={config.partitioner.name} does not apply to "
                         "dataset=synthetic: each device generates its own data "
                         "(dataset.skew sets how far devices differ)")
    model = build_model_from_config(config.model, config.dataset)
    # The client step checks what it needs of the model (cut, tail cut, head).
    check_planner(config, protocol, model)
    spec = run_spec(cfg, host_flops_per_s=0.0)
    for cut in sorted({config.model.cut, *cuts_in_play(config, model)}):  # a planner's too
        step = protocol.client(model, spec, cut=cut)
    check_compression_applies(config, step)
    if config.privacy.nopeek_weight and not issubclass(protocol.client, SplitStep):
        raise ValueError(
            f"privacy.nopeek_weight={config.privacy.nopeek_weight} regularises the split "
            f"protocols' device side (splitfed_v1, splitfed_v2, sglr, sequential), not "
            f"strategy={protocol.name}"
        )
    if config.privacy.gradient_noise_multiplier and protocol.name != "ushaped":
        raise ValueError(
            f"privacy.gradient_noise_multiplier={config.privacy.gradient_noise_multiplier} noises "
            f"the gradient a U-shaped device returns; strategy={protocol.name} returns none "
            "(use strategy=ushaped)"
        )
    if config.privacy.name == "activation_gaussian" and not protocol.client.sends_activations:
        raise ValueError(
            f"privacy=activation_gaussian protects activations; strategy={protocol.name} sends none"
        )
    check_error_feedback(config, protocol)
    check_privacy_source(config, model)
    check_client_runtime(config, protocol, model)
    check_device_privacy(config)
    check_trunk_workers(config)
    check_aggregation(config)
    build_fleet(num_clients=config.num_clients, mix=config.devices.mix,
                profiles={k: vars(v) for k, v in config.devices.profiles.items()},
                seed=config.seed)
    if config.strategy.min_train_nodes > config.num_clients:
        raise ValueError(
            f"strategy.min_train_nodes={config.strategy.min_train_nodes} exceeds "
            f"num_clients={config.num_clients}: no round could start"
        )


def check_error_feedback(config: Config, protocol: Protocol) -> None:
    """Refuse ``dataplane.compression.error_feedback`` where it is not built or not private.

    Error feedback keys its memory by each row's example id, which the device sends with
    the batch over the data plane: built for the split protocols, U-shaped and local loss
    streaming its smashed data (whose trunk sends nothing down, so only a lossy uplink
    has anything to feed back), and not with activation noise, whose accounting assumes
    the trunk cannot tell which noised rows are the same example.
    """
    compression = config.dataplane.compression
    if not compression.error_feedback:
        return
    if not issubclass(protocol.client, (SplitStep, UShapedStep, LocalLossStep)):
        raise ValueError(
            "dataplane.compression.error_feedback=true is built for the split protocols "
            f"(splitfed_v1, splitfed_v2, sglr, sequential), ushaped and local_loss, not "
            f"strategy={protocol.name}"
        )
    if issubclass(protocol.client, LocalLossStep) and not compression.uplink_feedback:
        raise ValueError(
            "dataplane.compression.error_feedback=true with strategy=local_loss needs a lossy "
            f"dataplane.compression.uplink (got {compression.uplink!r}): the trunk sends "
            "nothing down, so the uplink is all there is to feed back")
    if config.privacy.name == "activation_gaussian":
        raise ValueError(
            "dataplane.compression.error_feedback=true sends each row's example id, which "
            "links an example's noised releases across epochs; not with "
            "privacy=activation_gaussian"
        )


def check_compression_applies(config: Config, step: ClientStep) -> None:
    """Refuse compression where no data plane carries the tensors it would encode.

    FedAvg sends whole models, and local loss in bulk mode its smashed data in the Flower
    reply, as computed: a ``compression=`` there would change nothing, silently.
    """
    compression = config.dataplane.compression
    if step.needs_channel or compression.uplink == compression.downlink == "none":
        return
    mode = " with strategy.bulk=true" if getattr(config.strategy, "bulk", False) else ""
    raise ValueError(
        f"dataplane.compression (uplink={compression.uplink!r}, downlink="
        f"{compression.downlink!r}) encodes the tensors on the data plane; strategy="
        f"{config.strategy.name}{mode} uses none (use compression=none"
        + (", or strategy.bulk=false)" if mode else ")"))


def check_trunk_workers(config: Config) -> None:
    """Refuse ``dataplane.trunk_workers`` > 1 where it is not built (ValueError).

    Only SplitFed v2's shared trunk is sharded (the other protocols either keep a
    copy per client already or hold state across a round that one process must
    see), and the adaptive planners model one trunk that serialises every step.
    """
    workers = config.dataplane.trunk_workers
    if workers == 1:
        return
    if config.strategy.name != "splitfed_v2":
        raise ValueError(f"dataplane.trunk_workers={workers} shards SplitFed v2's shared trunk; "
                         f"strategy={config.strategy.name} runs its trunk in one process "
                         "(use dataplane.trunk_workers=1)")
    if config.planner.adaptive:
        raise ValueError(f"dataplane.trunk_workers={workers} with planner={config.planner.name}: "
                         "the planners model one trunk that serialises every step; use "
                         "planner=uniform or dataplane.trunk_workers=1")


def check_client_runtime(config: Config, protocol: Protocol, model: SplittableModel) -> None:
    """Refuse ``devices.runtime=executorch`` where the exported program cannot train (ValueError).

    The program is the split step's device side, without privacy, checkpointing or
    buffers (see :mod:`clients.steps.executorch`), checked at every cut in play.
    """
    if config.devices.runtime == "eager":
        return
    from clients.steps.executorch import bottom_refusal, executorch_refusal
    from splitlearn.split import split

    checkpoint = config.planner.adaptive and config.planner.checkpointing
    refusal = executorch_refusal(protocol.name, config.privacy, checkpoint=checkpoint)
    if refusal is not None:
        raise ValueError(refusal)
    for cut in cuts_in_play(config, model):
        refusal = bottom_refusal(split(model, cut)[0])
        if refusal is not None:
            raise ValueError(f"model={config.model.name} at cut {cut}: {refusal}")


def check_device_privacy(config: Config) -> None:
    """Refuse ``privacy.per_device`` entries that name no device preset of the run (ValueError)."""
    from clients.device import preset_profiles

    known = set(config.devices.profiles) | set(preset_profiles())
    unknown = sorted(set(config.privacy.per_device) - known)
    if unknown:
        raise ValueError(f"privacy.per_device names {unknown}, not device presets; known: "
                         f"{sorted(known)}")


def check_aggregation(config: Config) -> None:
    """Refuse secure aggregation or DP-FedAvg where no average of equal arrays exists.

    Both act on the average of the client-side weights: sequential SL passes the
    weights from device to device (no average), local loss in bulk mode replies with
    the smashed data the trunk must read, and per-client cuts give devices arrays of
    different shapes (SecAgg+ sums vectors of one shape; one clip bound would cover
    different stages).
    """
    agg = config.aggregation
    if not (agg.secure or agg.clipped):
        return
    key = ("aggregation.secure=true" if agg.secure
           else f"aggregation.update_clip_norm={agg.update_clip_norm}")
    if config.strategy.name == "sequential":
        raise ValueError(f"{key} acts on the average of the devices' weights; strategy=sequential "
                         "passes them from device to device and averages nothing")
    if getattr(config.strategy, "bulk", False):
        raise ValueError(f"{key} with strategy.bulk=true: the reply carries the smashed data "
                         "the trunk trains on; use strategy.bulk=false (the data plane)")
    if config.planner.adaptive:
        raise ValueError(f"{key} with planner={config.planner.name}: devices at different cuts "
                         "hold arrays of different shapes; use planner=uniform")
    if agg.secure and config.strategy.min_train_nodes < 2:
        raise ValueError(f"{key} needs strategy.min_train_nodes >= 2 (got "
                         f"{config.strategy.min_train_nodes}): one device's mask hides nothing")


def check_privacy_source(config: Config, model: SplittableModel) -> None:
    """Refuse a model whose client side the privacy option cannot protect (ValueError).

    Checked at every cut a client may be given: ``model.cut``, or with an adaptive
    planner each cut it may choose (``planner.cuts``, else every valid cut).
    """
    from splitlearn.privacy import PRIVACY_OPTIONS
    from splitlearn.split import split

    option = PRIVACY_OPTIONS[config.privacy.name]
    for cut in cuts_in_play(config, model):
        bottom, _ = split(model, cut)
        try:
            option.check_source(bottom)
        except ValueError as err:
            raise ValueError(f"model={config.model.name} at cut {cut}: {err}") from err


def cuts_in_play(config: Config, model: SplittableModel) -> list[int]:
    """Return the cuts a client of this run may hold.

    ``model.cut``, or with an adaptive planner each cut it may choose:
    ``planner.cuts`` (checked by :func:`check_planner`), else every valid cut
    (below the tail cut, for U-shaped learning).
    """
    if not config.planner.adaptive:
        return [config.model.cut]
    if config.planner.cuts:
        return list(config.planner.cuts)
    tail_cut = tail_cut_of(config.strategy, model)
    return [c for c in model.valid_cuts if tail_cut is None or c < tail_cut]


def tail_cut_of(options: StrategyConfig, model: SplittableModel) -> int | None:
    """Return the first stage of a U-shaped device's tail (None for other protocols)."""
    tail_cut = getattr(options, "tail_cut", None)
    if tail_cut is None:
        return None
    return tail_cut or model.num_stages - 1


def check_planner(config: Config, protocol: Protocol, model: SplittableModel) -> None:
    """Refuse a planner the protocol or the model cannot follow (ValueError naming the key)."""
    planner = config.planner
    if not planner.adaptive:
        return
    if not protocol.per_client_cuts:
        accepted = sorted(p.name for p in PROTOCOLS.values() if p.per_client_cuts)
        raise ValueError(
            f"planner={planner.name} gives clients different cuts; strategy={protocol.name} "
            f"needs one cut for all (planner=uniform), or use strategy in {accepted}"
        )
    tail_cut = tail_cut_of(config.strategy, model)
    for cut in planner.cuts or []:
        try:
            model.check_cut(cut)
        except ValueError as err:
            raise ValueError(f"planner.cuts: {err}") from err
        if tail_cut is not None and cut >= tail_cut:
            raise ValueError(f"planner.cuts: cut {cut} leaves the trunk no stage below the "
                             f"U-shaped tail cut {tail_cut}")
    unknown = sorted(set(planner.leak) - set(model.valid_cuts))
    if unknown:
        raise ValueError(f"planner.leak names cuts {unknown}; valid cuts: {model.valid_cuts}")
