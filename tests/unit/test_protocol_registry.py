"""Every protocol builds from its shipped config; privacy only where it applies."""

from __future__ import annotations

import pytest

from server.app import PROTOCOLS, make_strategy, start_runtime, stop_runtime
from splitlearn.config import CONF_DIR, compose_config
from strategies.splitfed import SplitFed

SHIPPED = sorted(p.stem for p in (CONF_DIR / "strategy").glob("*.yaml"))


@pytest.fixture
def runtime_for(tmp_path):
    runtimes = []

    def start(*overrides):
        cfg = compose_config(["logger=none", *overrides])
        cfg.run_dir = str(tmp_path)
        runtimes.append(start_runtime(cfg))
        return runtimes[-1]

    yield start
    for runtime in runtimes:
        stop_runtime(runtime)


def test_every_shipped_strategy_is_registered():
    assert set(SHIPPED) == set(PROTOCOLS)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_protocol_builds(runtime_for, name):
    strategy = make_strategy(runtime_for(f"strategy={name}"))
    assert isinstance(strategy, SplitFed)
    assert strategy.train_message_type.startswith("train.")


@pytest.mark.parametrize("name", ["ushaped", "local_loss", "fedavg"])
def test_privacy_is_refused_where_the_client_loop_does_not_apply_it(runtime_for, name):
    runtime = runtime_for(f"strategy={name}", "privacy=activation_gaussian")
    with pytest.raises(ValueError, match=f"privacy='activation_gaussian'.*strategy='{name}'"):
        make_strategy(runtime)
