"""A node verifies the trunk by its own roots when it has them, and then refuses plaintext."""

from __future__ import annotations

import pytest

from clients.app import TRUNK_ROOTS_KEY, trunk_trust
from splitlearn.config import RunSpec
from splitlearn.dataplane import TrunkRejected

TASK_PEM = "-----BEGIN CERTIFICATE-----\ntask\n-----END CERTIFICATE-----\n"
NODE_PEM = "-----BEGIN CERTIFICATE-----\nnode\n-----END CERTIFICATE-----\n"


@pytest.fixture
def node_roots(tmp_path):
    path = tmp_path / "roots.pem"
    path.write_text(NODE_PEM)
    return {TRUNK_ROOTS_KEY: str(path), "partition-id": 0, "num-partitions": 2}


def test_a_node_without_roots_takes_the_tasks():
    spec = RunSpec(trunk_tls=True, trunk_root_certificates=TASK_PEM)
    assert trunk_trust(spec, {}, address="10.0.0.1:5") is spec
    plain = RunSpec()
    assert trunk_trust(plain, {}, address="10.0.0.1:5") is plain


def test_a_node_with_roots_uses_only_its_own(node_roots):
    spec = RunSpec(trunk_tls=True, trunk_root_certificates=TASK_PEM)
    mine = trunk_trust(spec, node_roots, address="10.0.0.1:5")
    assert mine.trunk_tls and mine.trunk_root_certificates == NODE_PEM
    # Nor can a task that names no roots (system roots) widen what the node trusts.
    assert trunk_trust(RunSpec(trunk_tls=True), node_roots,
                       address="10.0.0.1:5").trunk_root_certificates == NODE_PEM


def test_a_node_with_roots_refuses_a_plaintext_trunk(node_roots):
    with pytest.raises(TrunkRejected, match="10.0.0.1:5 does not serve TLS") as info:
        trunk_trust(RunSpec(), node_roots, address="10.0.0.1:5")
    assert info.value.kind == "refused"
    # A round without a trunk (FedAvg) has nothing to refuse.
    assert trunk_trust(RunSpec(), node_roots, address="").trunk_root_certificates == NODE_PEM


def test_unreadable_roots_are_refused_naming_the_key(tmp_path):
    config = {TRUNK_ROOTS_KEY: str(tmp_path / "missing.pem")}
    with pytest.raises(TrunkRejected, match=f"{TRUNK_ROOTS_KEY}=.*missing.pem: cannot read"):
        trunk_trust(RunSpec(trunk_tls=True), config, address="10.0.0.1:5")
