"""Every shipped config composes; typos and wrong types fail naming the key."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from splitlearn.config import CONF_DIR, compose_config

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "scenario")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "override", [f"{g}={o}" for g in GROUPS for o in options(g)], ids=lambda s: s
)
def test_every_group_option_composes(override):
    group, option = override.split("=")
    cfg = compose_config([override])
    assert cfg[group].name == option


@pytest.mark.parametrize("scenario", options("scenario"))
def test_every_scenario_composes(scenario):
    cfg = compose_config([f"+scenario={scenario}"])
    assert cfg.scenario == scenario


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


def cause_chain(err: BaseException) -> str:
    text = []
    while err is not None:
        text.append(str(err))
        err = err.__cause__ or err.__context__
    return "\n".join(text)


def test_misspelt_key_fails_with_its_name():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["strategy.num_roundz=3"])
    assert "strategy.num_roundz" in cause_chain(info.value)


@pytest.mark.parametrize(
    ("override", "key"),
    [("strategy.lr=fast", "lr"), ("num_clients=many", "num_clients"),
     ("model.cut=[1]", "cut"), ("dataplane.port=x", "port")],
)
def test_wrong_type_fails_with_the_key(override, key):
    with pytest.raises(ConfigCompositionException) as info:
        compose_config([override])
    assert key in cause_chain(info.value)


def test_misspelt_key_in_a_yaml_file_fails_with_its_name(tmp_path):
    # A scenario file with a typo is rejected by the schema when composed.
    from omegaconf import OmegaConf

    from splitlearn.config import Config

    schema = OmegaConf.structured(Config)
    with pytest.raises((ConfigKeyError, ValidationError)) as info:
        OmegaConf.merge(schema, OmegaConf.create({"strategy": {"local_epoch": 2}}))
    assert "local_epoch" in str(info.value)
