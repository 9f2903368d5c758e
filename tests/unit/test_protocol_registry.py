"""Every protocol builds from its shipped config; privacy only where it applies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid
from omegaconf import OmegaConf

from protocols import PROTOCOLS, check_config, protocol_named
from server.app import (
    REPLY_POLL_S,
    SplitRuntime,
    build_trunk,
    collect_replies_promptly,
    initial_arrays,
    make_strategy,
    start_runtime,
    stop_runtime,
)
from splitlearn.config import CONF_DIR, decode_spec, run_spec
from splitlearn.messages import ROUND_KEY, SPEC_KEY
from strategies.privacy import PrivacyBudgetGuard
from strategies.reporting import ReportingFedAvg
from strategies.splitfed import SplitFed
from tests.conftest import small_config
from tests.helpers import ScriptedGrid

SHIPPED = sorted(p.stem for p in (CONF_DIR / "strategy").glob("*.yaml"))


pytestmark = pytest.mark.usefixtures("task_identity")


class Reporter:
    """Stands in for the RoundReporter: make_strategy only hands its hook to the strategy."""

    def __init__(self) -> None:
        self.outcomes = []

    def record_round(self, outcome) -> None:  # noqa: ANN001
        self.outcomes.append(outcome)


@pytest.fixture
def runtime_for(tmp_path) -> Iterator:
    runtimes: list[SplitRuntime] = []

    def start(*overrides: str) -> SplitRuntime:
        runtimes.append(start_runtime(small_config(*overrides, run_dir=str(tmp_path))))
        return runtimes[-1]

    yield start
    for runtime in runtimes:
        stop_runtime(runtime)


def test_every_shipped_strategy_is_a_registered_protocol_and_vice_versa():
    assert SHIPPED == sorted(PROTOCOLS)
    for name in SHIPPED:
        shipped = yaml.safe_load((CONF_DIR / "strategy" / f"{name}.yaml").read_text())
        assert shipped["name"] == name
        assert shipped["defaults"][0] == f"{name}_schema"  # typed by the protocol's options
        assert protocol_named(name) is PROTOCOLS[name] and PROTOCOLS[name].name == name


def test_an_unknown_protocol_is_refused_naming_the_accepted_ones():
    with pytest.raises(ValueError, match=r"strategy.name='nope'.*splitfed_v2"):
        protocol_named("nope")


@pytest.mark.parametrize("name", SHIPPED)
def test_every_protocol_builds_its_parts_from_the_composed_config(name):
    protocol = PROTOCOLS[name]
    cfg = small_config(f"strategy={name}", run_dir="unused")
    assert OmegaConf.get_type(cfg.strategy) is protocol.options
    check_config(cfg)
    trunk, handler, tokens, endpoint = build_trunk(cfg)
    if protocol.trunk is None:
        assert handler is None and endpoint.handlers == {}
    else:
        assert endpoint.handlers == {name: handler}
        for method in ("handle", "attach", "detach", "finish_round"):
            assert callable(getattr(handler, method)), method
    spec = run_spec(cfg, host_flops_per_s=0.0)
    assert isinstance(spec.strategy, protocol.options) and spec.strategy.name == name
    step = protocol.client(trunk.model, spec, cut=cfg.model.cut)
    assert isinstance(step, protocol.client)
    assert set(step.state())  # the client side has weights


@pytest.mark.parametrize("name", SHIPPED)
def test_every_protocol_strategy_sends_its_typed_messages(runtime_for, name):
    protocol = PROTOCOLS[name]
    runtime = runtime_for(f"strategy={name}", "dataplane.node_keys=true")
    reporter = Reporter()
    strategy = make_strategy(runtime, reporter)
    assert isinstance(strategy, protocol.strategy) and isinstance(strategy, ReportingFedAvg)
    assert strategy.protocol == name and strategy.on_round == reporter.record_round
    assert isinstance(strategy, SplitFed) == (protocol.trunk is not None)
    arrays = initial_arrays(runtime)
    step = protocol.client(runtime.trunk.model, runtime.spec, cut=runtime.spec.model.cut)
    grid = ScriptedGrid([1, 2, 3], answer=lambda m: m)
    messages: list[Message] = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    assert len(messages) == 3
    for message in messages:
        assert message.metadata.message_type == f"train.{name}"
        content: RecordDict = message.content
        assert set(content[strategy.arrayrecord_key]) == set(step.state())  # what it will hold
        # What the ClientApp decodes: the spec against the protocol's schema.
        spec = decode_spec(str(content["config"][SPEC_KEY]), strategy=protocol.options)
        assert spec == runtime.spec
        data = content[ROUND_KEY]
        assert data["server_round"] == 1 and data["cut"] == runtime.spec.model.cut
        if protocol.trunk is None:
            assert "token" not in data
            continue
        assert data["trunk_address"] == runtime.service.address
        grant = runtime.tokens.lookup(str(data["token"]))
        assert grant.protocol == name and grant.client == str(message.metadata.dst_node_id)
        assert grant.node_key is not None  # learned over Flower before the token was issued
        assert grant.protocol in runtime.endpoint.handlers  # the trunk serves the session


@pytest.mark.parametrize("name", SHIPPED)
def test_privacy_wraps_every_protocol_in_the_budget_guard(runtime_for, name):
    runtime = runtime_for(f"strategy={name}", "privacy=dpsgd_client")
    guard = make_strategy(runtime, Reporter())
    assert isinstance(guard, PrivacyBudgetGuard)
    assert isinstance(guard.strategy, PROTOCOLS[name].strategy)


@pytest.mark.parametrize("name", SHIPPED)
def test_activation_privacy_is_refused_only_where_no_activations_are_sent(name):
    cfg = small_config(f"strategy={name}", "privacy=activation_gaussian", run_dir="unused")
    if PROTOCOLS[name].capabilities.sends_activations:
        check_config(cfg)
    else:
        with pytest.raises(ValueError, match=rf"privacy=activation_gaussian.*strategy={name}"):
            check_config(cfg)


def test_activation_privacy_is_refused_for_fedavg_alone():
    # Pins the registry's answer, so the test above cannot pass by refusing nothing.
    refusing = sorted(n for n, p in PROTOCOLS.items() if not p.capabilities.sends_activations)
    assert refusing == ["fedavg"]
    assert {"ushaped", "local_loss", "splitfed_v1", "splitfed_v2", "sequential"} <= set(PROTOCOLS)


@pytest.mark.parametrize("name", SHIPPED)
def test_client_side_privacy_is_accepted_for_every_protocol(name):
    check_config(small_config(f"strategy={name}", "privacy=dpsgd_client", run_dir="unused"))


def test_the_simulation_engines_grid_is_polled_promptly_and_other_grids_are_left_alone():
    # The grid Flower's Simulation Engine gives the ServerApp, built as the engine builds it.
    grid = InMemoryGrid(state_factory=LinkStateFactory(
        FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory()))
    assert grid.pull_interval > REPLY_POLL_S  # Flower's own
    collect_replies_promptly(grid)
    assert grid.pull_interval == REPLY_POLL_S
    scripted = ScriptedGrid([1], answer=lambda message: None)
    collect_replies_promptly(scripted)
    assert not hasattr(scripted, "pull_interval")
