"""Checks of a composed config before anything starts, asked of the protocol registry.

:func:`check_config` refuses a run that could only fail later, naming the offending key
and what is accepted; every protocol-specific question goes to the protocol's entry
(:class:`~protocols.spec.Capabilities`), never to its name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from protocols.registry import PROTOCOLS, protocol_named, runtime_refusal
from protocols.spec import Capabilities, Protocol
from splitlearn.accelerators import resolve_device
from splitlearn.config import Config, check_keys, run_spec, to_object
from splitlearn.models import SplittableModel
from splitlearn.optim import check_optimizers


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

    check_keys(cfg)
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
    check_compression_applies(config, protocol, step.needs_channel)
    check_privacy_applies(config, protocol)
    check_error_feedback(config, protocol)
    check_privacy_source(config, model)
    check_client_runtime(config, protocol, model)
    check_optimizers(config.strategy, light_only_devices=light_only_runtime(config))
    resolve_device(config.server.device)  # a device this machine lacks, refused by name
    check_device_privacy(config)
    check_trunk_workers(config)
    check_aggregation(config)
    check_robust_aggregation(config)
    build_fleet(num_clients=config.num_clients, mix=config.devices.mix,
                profiles={k: vars(v) for k, v in config.devices.profiles.items()},
                seed=config.seed)
    if config.strategy.min_train_nodes > config.num_clients:
        raise ValueError(
            f"strategy.min_train_nodes={config.strategy.min_train_nodes} exceeds "
            f"num_clients={config.num_clients}: no round could start"
        )


def accepting(has: Callable[[Capabilities], object]) -> list[str]:
    """Return the protocols whose capabilities satisfy ``has``, for error messages."""
    return sorted(p.name for p in PROTOCOLS.values() if has(p.capabilities))


def check_privacy_applies(config: Config, protocol: Protocol) -> None:
    """Refuse a privacy setting that acts on something the protocol's devices do not do."""
    privacy, caps = config.privacy, protocol.capabilities
    if privacy.nopeek_weight and not caps.nopeek:
        raise ValueError(
            f"privacy.nopeek_weight={privacy.nopeek_weight} regularises the split step's "
            f"device side ({accepting(lambda c: c.nopeek)}), not strategy={protocol.name}")
    if privacy.gradient_noise_multiplier and caps.device_tail is None:
        raise ValueError(
            f"privacy.gradient_noise_multiplier={privacy.gradient_noise_multiplier} noises the "
            f"gradient a device with a tail returns; strategy={protocol.name} returns none "
            f"(use strategy in {accepting(lambda c: c.device_tail)})")
    if privacy.name == "activation_gaussian" and not caps.sends_activations:
        raise ValueError(
            f"privacy=activation_gaussian protects activations; strategy={protocol.name} "
            "sends none")


def check_error_feedback(config: Config, protocol: Protocol) -> None:
    """Refuse ``dataplane.compression.error_feedback`` where it is not built or not private.

    Error feedback keys its memory by each row's example id, which the device sends with
    the batch over the data plane: built where the protocol's capabilities say so (where
    the trunk sends nothing down, only a lossy uplink has anything to feed back), and not
    with activation noise, whose accounting assumes the trunk cannot tell which noised
    rows are the same example.
    """
    compression = config.dataplane.compression
    if not compression.error_feedback:
        return
    if not protocol.capabilities.error_feedback:
        raise ValueError(
            "dataplane.compression.error_feedback=true is built for "
            f"{accepting(lambda c: c.error_feedback)}, not strategy={protocol.name}")
    if not protocol.client.receives_gradient and not compression.uplink_feedback:
        raise ValueError(
            f"dataplane.compression.error_feedback=true with strategy={protocol.name} needs a "
            f"lossy dataplane.compression.uplink (got {compression.uplink!r}): the trunk sends "
            "nothing down, so the uplink is all there is to feed back")
    if config.privacy.name == "activation_gaussian":
        raise ValueError(
            "dataplane.compression.error_feedback=true sends each row's example id, which "
            "links an example's noised releases across epochs; not with "
            "privacy=activation_gaussian"
        )


def check_compression_applies(config: Config, protocol: Protocol, needs_channel: bool) -> None:
    """Refuse compression where no data plane carries the tensors it would encode.

    A protocol without a trunk sends whole models, and one whose options ship the
    activations in the Flower reply sends them as computed: a ``compression=`` there
    would change nothing, silently.
    """
    compression = config.dataplane.compression
    if needs_channel or compression.uplink == compression.downlink == "none":
        return
    payload = protocol.reply_payload(config.strategy)
    mode = f" with {payload}" if payload else ""
    raise ValueError(
        f"dataplane.compression (uplink={compression.uplink!r}, downlink="
        f"{compression.downlink!r}) encodes the tensors on the data plane; strategy="
        f"{protocol.name}{mode} uses none (use compression=none"
        + (f", or drop {payload})" if payload else ")"))


def check_trunk_workers(config: Config) -> None:
    """Refuse ``dataplane.trunk_workers`` > 1 where it is not built (ValueError).

    Only a trunk whose protocol says it can be sharded is (the others either keep a
    copy per client already or hold state across a round that one process must
    see), and the adaptive planners model one trunk that serialises every step.
    """
    workers = config.dataplane.trunk_workers
    if workers == 1:
        return
    if not protocol_named(config.strategy.name).capabilities.shards_trunk:
        raise ValueError(f"dataplane.trunk_workers={workers} shards the shared trunk of "
                         f"{accepting(lambda c: c.shards_trunk)}; strategy="
                         f"{config.strategy.name} runs its trunk in one process (use "
                         "dataplane.trunk_workers=1)")
    if config.planner.adaptive:
        raise ValueError(f"dataplane.trunk_workers={workers} with planner={config.planner.name}: "
                         "the planners model one trunk that serialises every step; use "
                         "planner=uniform or dataplane.trunk_workers=1")


def check_client_runtime(config: Config, protocol: Protocol, model: SplittableModel) -> None:
    """Refuse device runtimes that cannot train this run's device step (ValueError).

    ``devices.runtime=executorch``'s program is the split step's device side (protocols
    whose capabilities list the runtime), without privacy, activation recomputation or
    buffers (:mod:`splitlearn.runtimes`). With ``devices.web`` phones may join: the web
    runtime runs the protocols listing ``web``, on the layers it declares
    (:mod:`splitlearn.web`). Both are checked at every cut in play.
    """
    recompute = config.planner.adaptive and config.planner.recompute
    if config.devices.runtime != "eager":
        check_executorch(config, protocol, model, recompute=recompute)
    if config.devices.web:
        check_web(config, protocol, model, recompute=recompute)


def light_only_runtime(config: Config) -> str | None:
    """Return the setting whose device runtime steps plain SGD only (None: any optimiser)."""
    from splitlearn.runtimes import EXECUTORCH_KEY, WEB_KEY

    if config.devices.runtime == "executorch":
        return EXECUTORCH_KEY
    return WEB_KEY if config.devices.web else None


def check_executorch(config: Config, protocol: Protocol, model: SplittableModel, *,
                     recompute: bool) -> None:
    """Refuse ``devices.runtime=executorch`` where the exported program cannot train."""
    from splitlearn.runtimes import bottom_refusal, executorch_refusal
    from splitlearn.stages import split

    refusal = (runtime_refusal(protocol, config.devices.runtime)
               or executorch_refusal(config.privacy, recompute=recompute))
    if refusal is not None:
        raise ValueError(refusal)
    for cut in cuts_in_play(config, model):
        refusal = bottom_refusal(split(model, cut)[0])
        if refusal is not None:
            raise ValueError(f"model={config.model.name} at cut {cut}: {refusal}")


def check_web(config: Config, protocol: Protocol, model: SplittableModel, *,
              recompute: bool) -> None:
    """Refuse ``devices.web=true`` where a phone's web runtime cannot train the device step."""
    from splitlearn.runtimes import WEB_KEY, web_refusal
    from splitlearn.web import device_parts, stages_refusal

    if "web" not in protocol.capabilities.runtimes:
        accepted = accepting(lambda c: "web" in c.runtimes)
        raise ValueError(f"{WEB_KEY}: the web runtime runs the device step of {accepted}; "
                         f"strategy={protocol.name} has another")
    if protocol.capabilities.trunk != "none" and config.dataplane.websocket_port is None:
        raise ValueError(f"{WEB_KEY}: phones reach the trunk over its WebSocket service; set "
                         "dataplane.websocket_port (0: any free port)")
    refusal = web_refusal(config.privacy, config.dataplane.compression, recompute=recompute)
    if refusal is not None:
        raise ValueError(refusal)
    tail = protocol.first_tail_stage(config.strategy, len(model.stages))
    for cut in cuts_in_play(config, model):
        for stages, input_shape in device_parts(model, cut, tail):
            refusal = stages_refusal(stages, input_shape)
            if refusal is not None:
                raise ValueError(f"{WEB_KEY}, model={config.model.name} at cut {cut}: "
                                 f"{refusal}")


def check_device_privacy(config: Config) -> None:
    """Refuse ``privacy.per_device`` entries that name no device preset of the run (ValueError)."""
    from splitlearn.planning.devices import preset_profiles

    known = set(config.devices.profiles) | set(preset_profiles())
    unknown = sorted(set(config.privacy.per_device) - known)
    if unknown:
        raise ValueError(f"privacy.per_device names {unknown}, not device presets; known: "
                         f"{sorted(known)}")


def check_aggregation(config: Config) -> None:
    """Refuse secure aggregation or DP-FedAvg where no average of equal arrays exists.

    Both act on the average of the client-side weights: a protocol may pass the
    weights from device to device (no average) or, by its options, reply with the
    smashed data the trunk must read, and per-client cuts give devices arrays of
    different shapes (SecAgg+ sums vectors of one shape; one clip bound would cover
    different stages).
    """
    agg = config.aggregation
    if not (agg.secure or agg.clipped):
        return
    key = ("aggregation.secure=true" if agg.secure
           else f"aggregation.update_clip_norm={agg.update_clip_norm}")
    protocol = protocol_named(config.strategy.name)
    if not protocol.capabilities.averages_device_weights:
        raise ValueError(f"{key} acts on the average of the devices' weights; strategy="
                         f"{protocol.name} passes them from device to device and averages "
                         "nothing")
    payload = protocol.reply_payload(config.strategy)
    if payload:
        raise ValueError(f"{key} with {payload}: the reply carries the smashed data the trunk "
                         "trains on; drop it (the data plane)")
    if config.planner.adaptive:
        raise ValueError(f"{key} with planner={config.planner.name}: devices at different cuts "
                         "hold arrays of different shapes; use planner=uniform")
    if agg.secure and config.strategy.min_train_nodes < 2:
        raise ValueError(f"{key} needs strategy.min_train_nodes >= 2 (got "
                         f"{config.strategy.min_train_nodes}): one device's mask hides nothing")


def round_devices(config: Config) -> int:
    """Return the devices a round samples when every one of ``num_clients`` is connected.

    Flower's FedAvg samples ``max(int(connected x fraction_train), min_train_nodes)``.
    """
    strategy = config.strategy
    sampled = max(int(config.num_clients * strategy.fraction_train), strategy.min_train_nodes)
    return min(sampled, config.num_clients)


def check_robust_aggregation(config: Config) -> None:
    """Refuse ``aggregation.robust`` where it has nothing to act on or its assumption fails.

    It replaces the mean of the devices' copies, so the protocol must average them
    (its capabilities say so). Its combinations with SecAgg+ (the server sees only the
    sum) and DP-FedAvg's noise are refused by the config itself. Its assumption (the
    fewest copies for ``aggregation.num_malicious``: ``splitlearn.robust.RobustRule``)
    must hold for a full round, ``round_devices``; a round in which fewer devices
    finish keeps the device side's previous weights, and says so in its metrics. With
    per-client cuts a stage held by fewer devices than the round is checked each round.
    """
    from splitlearn.robust import RobustRule

    agg = config.aggregation
    rule = RobustRule.of(agg)
    if rule is None:
        return
    key = f"aggregation.robust={agg.robust}"
    protocol = protocol_named(config.strategy.name)
    if not protocol.capabilities.averages_device_weights:
        raise ValueError(f"{key} replaces the average of the devices' weights; strategy="
                         f"{protocol.name} passes them from device to device and averages "
                         "nothing")
    devices = round_devices(config)
    if (refusal := rule.refusal(devices)) is not None:
        raise ValueError(
            f"{key}: {refusal} (a round samples {devices} of num_clients={config.num_clients} "
            f"at strategy.fraction_train={config.strategy.fraction_train}, "
            f"strategy.min_train_nodes={config.strategy.min_train_nodes}); sample more devices "
            "or lower aggregation.num_malicious")
    if agg.robust == "multi_krum" and agg.multi_krum_selected > devices - agg.num_malicious:
        raise ValueError(
            f"aggregation.multi_krum_selected={agg.multi_krum_selected} exceeds the "
            f"{devices - agg.num_malicious} honest copies of a round ({devices} devices, "
            f"aggregation.num_malicious={agg.num_malicious}): it would average a Byzantine one")


def check_privacy_source(config: Config, model: SplittableModel) -> None:
    """Refuse a model whose client side the privacy option cannot protect (ValueError).

    Checked at every cut a client may be given: ``model.cut``, or with an adaptive
    planner each cut it may choose (``planner.cuts``, else every valid cut).
    """
    from splitlearn.privacy import PRIVACY_OPTIONS
    from splitlearn.stages import split

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
    (below the tail cut, where the device keeps a tail).
    """
    if not config.planner.adaptive:
        return [config.model.cut]
    if config.planner.cuts:
        return list(config.planner.cuts)
    tail_cut = tail_cut_of(config.strategy, model)
    return [c for c in model.valid_cuts if tail_cut is None or c < tail_cut]


def tail_cut_of(options: Any, model: SplittableModel) -> int | None:
    """Return the first stage of the device's tail for these ``strategy`` options (None: none)."""
    return protocol_named(str(options.name)).first_tail_stage(options, model.num_stages)


def check_planner(config: Config, protocol: Protocol, model: SplittableModel) -> None:
    """Refuse a planner the protocol or the model cannot follow (ValueError naming the key)."""
    planner = config.planner
    if not planner.adaptive:
        return
    if not protocol.capabilities.per_device_cuts:
        raise ValueError(
            f"planner={planner.name} gives clients different cuts; strategy={protocol.name} "
            f"needs one cut for all (planner=uniform), or use strategy in "
            f"{accepting(lambda c: c.per_device_cuts)}"
        )
    tail_cut = tail_cut_of(config.strategy, model)
    for cut in planner.cuts or []:
        try:
            model.check_cut(cut)
        except ValueError as err:
            raise ValueError(f"planner.cuts: {err}") from err
        if tail_cut is not None and cut >= tail_cut:
            raise ValueError(f"planner.cuts: cut {cut} leaves the trunk no stage below the "
                             f"device's tail cut {tail_cut}")
    unknown = sorted(set(planner.leak) - set(model.valid_cuts))
    if unknown:
        raise ValueError(f"planner.leak names cuts {unknown}; valid cuts: {model.valid_cuts}")
