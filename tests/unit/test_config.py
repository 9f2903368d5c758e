"""Every shipped config composes; typos, wrong types and impossible settings fail naming the key."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import ConfigKeyError, ValidationError

from protocols import PROTOCOLS, check_config, compose_config
from protocols.local_loss import LocalLossOptions
from protocols.splitfed import SplitFedV2Options
from protocols.ushaped import UShapedOptions
from splitlearn.config import (
    CONF_DIR,
    Config,
    DatasetConfig,
    DeviceProfileConfig,
    DevicesConfig,
    FailuresConfig,
    ModelConfig,
    PrivacyConfig,
    RunSpec,
    check_keys,
    decode_spec,
    encode_spec,
    run_spec,
)

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "scenario")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def composed(*overrides: str):  # noqa: ANN201 - a DictConfig ready for preflight
    cfg = compose_config(["logger=none", *overrides])
    cfg.run_dir = "unused"
    return cfg


def cause_chain(err: BaseException) -> str:
    text = []
    while err is not None:
        text.append(str(err))
        err = err.__cause__ or err.__context__
    return "\n".join(text)


# --- composition --------------------------------------------------------------------

#: Groups whose options land below the top level (their files' ``@package``).
PACKAGES = {"compression": "dataplane.compression"}


@pytest.mark.parametrize(
    "override", [f"{g}={o}" for g in GROUPS for o in options(g)], ids=lambda s: s
)
def test_every_group_option_composes_and_passes_preflight(override):
    group, option = override.split("=")
    cfg = compose_config([override])
    assert OmegaConf.select(cfg, PACKAGES.get(group, group)).name == option
    cfg.run_dir = "unused"
    check_config(cfg)


@pytest.mark.parametrize("scenario", options("scenario"))
def test_every_scenario_composes_and_passes_preflight(scenario):
    cfg = compose_config([f"+scenario={scenario}"])
    assert cfg != compose_config([])  # the scenario changes the run
    cfg.run_dir = "unused"
    check_config(cfg)


def test_the_groups_and_scenarios_are_all_found():
    # The parametrizations above must not be empty by accident.
    assert {"dataset", "model", "strategy", "privacy", "devices", "partitioner"} <= set(GROUPS)
    assert "heterogeneous" in options("scenario") and "splitfed_v2" in options("strategy")


def test_heterogeneous_scenario_is_dirichlet_half_over_ten_clients():
    cfg = compose_config(["+scenario=heterogeneous"])
    assert cfg.partitioner.name == "dirichlet"
    assert cfg.partitioner.alpha == 0.5
    assert cfg.num_clients == 10


def test_defaults_are_the_documented_experiment():
    cfg = compose_config()
    assert (cfg.dataset.name, cfg.model.name, cfg.strategy.name) == ("digits", "cnn", "splitfed_v2")
    assert cfg.num_clients == 10 and cfg.strategy.num_rounds <= 20
    assert cfg.logger.name == "wandb" and cfg.logger.mode == "auto"


# --- typos and types ----------------------------------------------------------------


def test_misspelt_key_fails_with_its_name():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["strategy.num_roundz=3"])
    assert "strategy.num_roundz" in cause_chain(info.value)


@pytest.mark.parametrize(
    ("override", "key"),
    [("strategy.lr=fast", "strategy.lr"), ("num_clients=many", "num_clients"),
     ("model.cut=[1]", "model.cut"), ("dataplane.port=x", "dataplane.port"),
     ("strategy=local_loss strategy.bulk=maybe", "strategy.bulk"),
     ("strategy=ushaped strategy.tail_cut=last", "strategy.tail_cut")],
)
def test_wrong_type_fails_with_the_key(override, key):
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(override.split())
    assert key in cause_chain(info.value)


def test_misspelt_key_in_a_yaml_file_fails_with_its_name():
    # A scenario file with a typo is rejected by the schema when composed.
    schema = OmegaConf.structured(Config)
    with pytest.raises((ConfigKeyError, ValidationError)) as info:
        OmegaConf.merge(schema, OmegaConf.create({"failures": {"dropout_rat": 0.5}}))
    assert "dropout_rat" in str(info.value)


# --- per-protocol schemas -----------------------------------------------------------


def test_every_protocol_composes_with_its_own_options_schema():
    for name, protocol in PROTOCOLS.items():
        cfg = compose_config([f"strategy={name}"])
        assert OmegaConf.get_type(cfg.strategy) is protocol.options, name


def test_bulk_is_a_local_loss_option_only():
    cfg = compose_config(["strategy=local_loss", "strategy.bulk=true"])
    assert cfg.strategy.bulk is True
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["strategy=splitfed_v2", "strategy.bulk=true"])
    assert "strategy.bulk" in cause_chain(info.value)


def test_tail_cut_is_a_ushaped_option():
    cfg = composed("strategy=ushaped", "strategy.tail_cut=3")
    assert cfg.strategy.tail_cut == 3
    check_config(cfg)  # cnn: cut 1 < tail_cut 3 < 5 stages
    assert run_spec(cfg, host_flops_per_s=0.0).strategy.tail_cut == 3
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["strategy=splitfed_v2", "strategy.tail_cut=3"])
    assert "strategy.tail_cut" in cause_chain(info.value)
    with pytest.raises(ValueError, match="tail_cut=1"):  # must be past the cut
        check_config(composed("strategy=ushaped", "strategy.tail_cut=1"))


def test_queue_bytes_replaced_queue_batches():
    assert composed("strategy=local_loss").strategy.queue_bytes > 0
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["strategy=local_loss", "strategy.queue_batches=4"])
    assert "strategy.queue_batches" in cause_chain(info.value)


# --- preflight ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["strategy.name=nope"], "strategy.name='nope'"),
        (["model.cut=5"], "model.cut"),
        (["model.cut=0"], "model.cut"),
        (["dataset=mnist", "dataset.path=/nonexistent/mnist"], "dataset.path='/nonexistent/mnist'"),
        (["dataset.path=/tmp"], "dataset.path='/tmp'"),  # digits reads no folder
        (["privacy=activation_gaussian", "privacy.noise_multiplier=0"],
         "privacy.noise_multiplier"),
        (["num_clients=3", "strategy.min_train_nodes=4"], "strategy.min_train_nodes=4"),
        (["devices=phones", "+devices.mix.toaster=0.5"], "devices.mix"),
        (["dataplane.ssl_certfile=/nonexistent/server.pem"], "dataplane.ssl_keyfile"),
        (["dataplane.ssl_ca_certfile=/nonexistent/ca.crt"], "dataplane.ssl_certfile"),
        (["dataplane.ssl_certfile=/nonexistent/server.pem",
          "dataplane.ssl_keyfile=/nonexistent/server.key"],
         "dataplane.ssl_certfile='/nonexistent/server.pem'"),
        (["dataplane.compression.error_feedback=true"], "dataplane.compression.error_feedback"),
        (["compression=int8", "strategy=fedavg"], "strategy=fedavg uses none"),
        (["compression=int8", "strategy=local_loss", "strategy.bulk=true"],
         "strategy=local_loss with strategy.bulk=true uses none"),
        (["compression=topk_feedback", "strategy=local_loss", "dataplane.compression.uplink=none"],
         "needs a lossy dataplane.compression.uplink (got 'none')"),
        (["compression=topk_feedback", "privacy=activation_gaussian"],
         "not with privacy=activation_gaussian"),
        (["compression=topk_feedback", "dataplane.compression.feedback_max_mib=0"],
         "dataplane.compression.feedback_max_mib"),
    ],
    ids=["unknown-protocol", "cut-past-the-end", "cut-zero", "missing-dataset-folder",
         "path-for-digits", "zero-noise", "too-few-clients", "undefined-profile",
         "tls-certificate-without-key", "tls-ca-without-certificate", "tls-missing-file",
         "feedback-with-nothing-dropped", "compression-fedavg", "compression-bulk",
         "feedback-local-loss-nothing-up",
         "feedback-activation-noise", "feedback-no-memory"],
)
def test_preflight_refuses_naming_the_key(overrides, key):
    cfg = composed(*overrides)
    with pytest.raises(ValueError) as info:
        check_config(cfg)
    assert key in str(info.value)


def test_preflight_accepts_the_same_settings_within_range(tmp_path):
    # The refusals above are about the values, not the keys.
    (tmp_path / "train-00000.parquet").write_bytes(b"")
    for overrides in (["model.cut=4"], ["dataset=mnist", f"dataset.path={tmp_path}"],
                      ["num_clients=3", "strategy.min_train_nodes=3"],
                      ["privacy=activation_gaussian", "privacy.noise_multiplier=0.5"],
                      ["devices=phones", "+devices.mix.wearable=0.5"],
                      ["compression=topk_feedback", "strategy=ushaped"],
                      ["compression=topk_feedback", "strategy=local_loss"],
                      ["compression=int8", "strategy=local_loss"]):
        check_config(composed(*overrides))


# --- the run spec -------------------------------------------------------------------


def spec_with_everything() -> RunSpec:
    return RunSpec(
        seed=3, torch_threads=2, max_frame_bytes=1 << 20, reply_timeout_s=12.5,
        dataset=DatasetConfig(name="mnist", path=None, image_size=None),
        model=ModelConfig(name="mine", _target_="pkg.nets.Net", cut=2,
                          options={"width": 4, "nested": {"sizes": [1, 2], "on": True}}),
        strategy=LocalLossOptions(bulk=True, aux_hidden=16, queue_bytes=1024, lr=0.1),
        privacy=PrivacyConfig(name="dpsgd_client", noise_multiplier=1.5, epsilon_max=None),
        failures=FailuresConfig(dropout_rate=0.25, round_deadline_s=None),
        devices=DevicesConfig(
            name="custom", mix={"board": 1.0}, emulate=True, host_flops_per_s=2.5e9,
            profiles={"board": DeviceProfileConfig(
                flops_per_s=1e9, memory_bytes=1 << 30, uplink_mbps=1.0, downlink_mbps=2.0,
                rtt_s=0.1)},
        ),
    )


def test_run_spec_round_trips_with_nested_values_nulls_dicts_and_protocol_options():
    spec = spec_with_everything()
    back = decode_spec(encode_spec(spec), strategy=LocalLossOptions)
    assert back == spec
    assert type(back.strategy) is LocalLossOptions and back.strategy.bulk is True
    assert back.model.options["nested"]["sizes"] == [1, 2]
    assert back.dataset.path is None and back.failures.round_deadline_s is None
    assert type(back.devices.profiles["board"]) is DeviceProfileConfig


@pytest.mark.parametrize("options", [SplitFedV2Options(batch_concurrent=True),
                                     UShapedOptions(tail_cut=3), LocalLossOptions(bulk=True)])
def test_run_spec_round_trips_each_protocols_options(options):
    spec = RunSpec(strategy=options)
    assert decode_spec(encode_spec(spec), strategy=type(options)) == spec


def test_run_spec_from_a_composed_config_round_trips():
    cfg = composed("strategy=ushaped", "strategy.tail_cut=3", "+scenario=flaky_network")
    spec = run_spec(cfg, host_flops_per_s=1.0e9)
    assert decode_spec(encode_spec(spec), strategy=UShapedOptions) == spec
    assert spec.failures.round_deadline_s == 5.0 and spec.devices.mix  # the scenario's


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (("seed: 3", "seed: 3\nseeed: 4"), "seeed"),  # unknown top-level key
        (("aux_hidden: 16", "aux_hiden: 16"), "aux_hiden"),  # unknown option
        (("seed: 3", "seed: three"), "seed"),  # mistyped
        (("bulk: true", "bulk: maybe"), "strategy.bulk"),
        (("cut: 2", "cut: two"), "model.cut"),
    ],
)
def test_decode_spec_refuses_unknown_or_mistyped_keys_naming_them(edit, key):
    text = encode_spec(spec_with_everything())
    old, new = edit
    assert old in text
    with pytest.raises(ValueError) as info:
        decode_spec(text.replace(old, new, 1), strategy=LocalLossOptions)
    assert key in str(info.value)


def test_decode_spec_refuses_another_protocols_options():
    text = encode_spec(RunSpec(strategy=LocalLossOptions(bulk=True)))
    with pytest.raises(ValueError) as info:
        decode_spec(text, strategy=SplitFedV2Options)
    assert "bulk" in str(info.value)


def test_privacy_settings_are_checked_when_the_config_becomes_objects():
    with pytest.raises(ValueError, match="privacy.noise_multiplier"):
        PrivacyConfig(name="dpsgd_client", noise_multiplier=0.0)
    with pytest.raises(ValueError, match="privacy.name"):
        PrivacyConfig(name="laplace")
    assert PrivacyConfig(name="none", noise_multiplier=0.0).accounted is False
    with pytest.raises(ValueError, match="privacy.nopeek_weight must be >= 0"):
        PrivacyConfig(nopeek_weight=-1.0)


@pytest.mark.parametrize("strategy", ["ushaped", "local_loss", "fedavg"])
def test_nopeek_is_refused_where_the_device_side_is_not_the_split_bottom(strategy):
    cfg = composed(f"strategy={strategy}", "privacy.nopeek_weight=1.0")
    with pytest.raises(ValueError, match=f"privacy.nopeek_weight=1.0 .* strategy={strategy}"):
        check_config(cfg)


@pytest.mark.parametrize("strategy", ["splitfed_v1", "sequential", "ushaped", "local_loss"])
def test_trunk_workers_are_refused_for_protocols_that_keep_one_trunk_process(strategy):
    cfg = composed(f"strategy={strategy}", "dataplane.trunk_workers=2")
    with pytest.raises(ValueError, match=f"dataplane.trunk_workers=2 .* strategy={strategy}"):
        check_config(cfg)


def test_trunk_workers_are_refused_with_an_adaptive_planner_and_below_one():
    with pytest.raises(ValueError, match="dataplane.trunk_workers=2 with planner=greedy"):
        check_config(composed("planner=greedy", "dataplane.trunk_workers=2"))
    with pytest.raises(ValueError, match="dataplane.trunk_workers=0: need at least 1"):
        check_config(composed("dataplane.trunk_workers=0"))
    check_config(composed("dataplane.trunk_workers=2"))  # SplitFed v2, uniform cuts


def test_trunk_tls_reaches_the_run_spec_with_its_ca(tmp_path):
    from experiments.certificates import make_certificates

    files = make_certificates(tmp_path)
    cfg = composed(f"dataplane.ssl_certfile={files.certificate}",
                   f"dataplane.ssl_keyfile={files.key}", f"dataplane.ssl_ca_certfile={files.ca}")
    check_config(cfg)
    spec = run_spec(cfg, host_flops_per_s=0.0)
    assert spec.trunk_tls and spec.trunk_root_certificates == files.ca.read_text()
    assert decode_spec(encode_spec(spec), strategy=SplitFedV2Options) == spec
    plain = run_spec(composed(), host_flops_per_s=0.0)
    assert not plain.trunk_tls and plain.trunk_root_certificates == ""


@pytest.mark.parametrize(("overrides", "message"), [
    (["+strategy.num_round=1"], "'strategy.num_round'.*did you mean strategy.num_rounds"),
    (["+model.dropout=0.5"], "'model.dropout'"),
    (["+seeed=3"], "'seeed'.*did you mean seed"),
    (["strategy=local_loss", "+strategy.tail_cut=2"], "'strategy.tail_cut'"),
], ids=["typo", "no-such-key", "root", "another-protocols-option"])
def test_a_key_added_with_plus_that_no_schema_has_fails_at_composition(overrides, message):
    with pytest.raises(ValueError, match=message):
        compose_config(overrides)


@pytest.mark.parametrize("override", [
    "planner.checkpointing=false", "+planner.checkpointing=false", "++planner.checkpointing=false",
], ids=["set", "add", "force-add"])
def test_a_renamed_key_fails_at_composition_naming_the_new_one(override):
    with pytest.raises(ValueError, match="'planner.checkpointing' was renamed to "
                                         "'planner.recompute'"):
        compose_config(["planner=smartsplit", override])


def test_a_renamed_key_that_reached_the_config_is_refused_naming_the_new_one():
    # What ``+planner.checkpointing=false`` leaves under ``@hydra.main`` (experiments.run).
    cfg = compose_config(["planner=smartsplit"])
    with open_dict(cfg.planner):
        cfg.planner.checkpointing = False
    with pytest.raises(ValueError, match="'planner.checkpointing' was renamed to "
                                         "'planner.recompute'"):
        check_keys(cfg)


def test_keys_a_schema_declares_open_or_optional_are_accepted_with_plus():
    cfg = compose_config(["+model.options.width=2", "+privacy.label_epsilon=2.0",
                          "strategy=ushaped", "strategy.tail_cut=3"])
    assert cfg.model.options.width == 2 and cfg.strategy.tail_cut == 3
