"""Hydra composition of the project's config, with every protocol's options schema registered."""

from __future__ import annotations

from omegaconf import DictConfig

from protocols.registry import PROTOCOLS
from splitlearn.config import CONF_DIR, Config, check_keys, check_overrides


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

    overrides = list(overrides or [])
    check_overrides(overrides)  # Hydra would refuse a renamed key without naming the new one
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    check_keys(cfg)  # a key added with ``+`` passes Hydra's struct mode
    return cfg
