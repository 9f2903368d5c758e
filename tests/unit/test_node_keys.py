"""Node keys: a token bound to a node's key opens only with that node's fresh proof."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.app import build_client_app
from experiments.local import LocalGrid
from server.app import deployed_config
from splitlearn.config import DataPlaneConfig
from splitlearn.dataplane import TokenRegistry, TrunkEndpoint
from splitlearn.dataplane.endpoint import SessionRefused
from splitlearn.dataplane.node_keys import (
    NODE_KEY_QUERY,
    NODE_KEY_RECORD,
    NONCE_BYTES,
    PUBLIC_KEY_FIELD,
    new_private_key,
    proof_problem,
    prove,
    public_key_of,
    public_key_problem,
    verifies,
)
from strategies.key_exchange import NodeKeys
from tests.conftest import small_config
from tests.helpers import ScriptedGrid

ALICE, BOB = new_private_key(), new_private_key()


class Idle:
    """A session handler that is never asked anything (these tests only open streams)."""

    def attach(self, session):  # noqa: ANN001, ANN201, D102
        pass

    def detach(self, session):  # noqa: ANN001, ANN201, D102
        pass

    def handle(self, session, request):  # noqa: ANN001, ANN201, D102
        raise AssertionError("no frame is sent")


def endpoint() -> TrunkEndpoint:
    dataplane = DataPlaneConfig(streams_per_token=4)
    return TrunkEndpoint({"p": Idle()}, TokenRegistry(), dataplane=dataplane)


def grant(ep: TrunkEndpoint, client: str, key: bytes | None) -> str:
    return ep.tokens.issue(client=client, protocol="p", cut=1, server_round=1, ttl_s=60,
                           node_key=None if key is None else public_key_of(key))


def test_a_proof_verifies_for_its_key_token_and_nonce_only():
    token = "t" * 32
    proof = prove(ALICE, token)
    assert proof_problem(proof) is None
    assert verifies(public_key_of(ALICE), token, proof)
    assert not verifies(public_key_of(BOB), token, proof)
    assert not verifies(public_key_of(ALICE), token + "x", proof)
    other_nonce = bytes([proof[0] ^ 1]) + proof[1:]
    assert not verifies(public_key_of(ALICE), token, other_nonce)
    assert proof != prove(ALICE, token)  # a fresh nonce each time
    assert proof_problem(None) and proof_problem(proof[:-1])
    with pytest.raises(ValueError, match="16 bytes"):
        prove(ALICE, token, nonce=b"short")


def test_public_keys_are_checked_before_they_are_kept():
    assert public_key_problem(public_key_of(ALICE)) is None
    assert "32 raw bytes" in public_key_problem(b"\x01" * 31)
    assert "32 raw bytes" in public_key_problem("not bytes")


def test_a_bound_token_opens_only_with_its_nodes_fresh_proof():
    ep = endpoint()
    token = grant(ep, "1", ALICE)
    grant(ep, "2", BOB)  # Bob holds a live grant of his own: his key is known
    with pytest.raises(SessionRefused, match="bound to node 1's key: no proof") as refused:
        ep.attach(token, lambda: None)
    assert refused.value.code == "UNAUTHENTICATED"
    with pytest.raises(SessionRefused, match="token belongs to another node: it was issued "
                       "to node 1, and the stream's proof is node 2's") as refused:
        ep.attach(token, lambda: None, proof=prove(BOB, token))
    assert refused.value.code == "PERMISSION_DENIED"
    with pytest.raises(SessionRefused, match="does not verify"):
        ep.attach(token, lambda: None, proof=prove(new_private_key(), token))
    proof = prove(ALICE, token)
    session, stream = ep.attach(token, lambda: None, proof=proof)
    assert session.grant.client == "1"
    ep.detach(session, stream)
    with pytest.raises(SessionRefused, match="replayed"):  # the same proof again
        ep.attach(token, lambda: None, proof=proof)
    ep.attach(token, lambda: None, proof=prove(ALICE, token))  # a fresh one is fine


def test_a_proof_for_one_token_does_not_open_another():
    ep = endpoint()
    first, second = grant(ep, "1", ALICE), grant(ep, "1", ALICE)
    with pytest.raises(SessionRefused, match="does not verify"):
        ep.attach(second, lambda: None, proof=prove(ALICE, first))


def test_an_unbound_token_is_a_bearer_secret_and_ignores_proofs():
    ep = endpoint()
    token = grant(ep, "1", None)
    ep.attach(token, lambda: None)
    ep.attach(token, lambda: None, proof=b"anything")


@settings(max_examples=200, deadline=None)
@given(proof=st.one_of(st.none(), st.binary(max_size=200),
                       st.binary(min_size=NONCE_BYTES + 64, max_size=NONCE_BYTES + 64)))
def test_no_forged_proof_opens_a_bound_token(proof):
    ep = endpoint()
    token = grant(ep, "1", ALICE)
    with pytest.raises(SessionRefused) as refused:
        ep.attach(token, lambda: None, proof=proof)
    assert refused.value.code == "UNAUTHENTICATED"
    assert ep.open_sessions == 0


def answer_with(key: object):  # noqa: ANN201
    def answer(message: Message) -> Message:
        record = ConfigRecord({PUBLIC_KEY_FIELD: key})  # type: ignore[dict-item]
        return Message(RecordDict({NODE_KEY_RECORD: record}), reply_to=message)

    return answer


def test_keys_are_asked_once_and_kept_for_the_nodes_that_answer_well(task_identity):
    keys = NodeKeys(timeout_s=5)
    good = public_key_of(ALICE)
    grid = ScriptedGrid([1, 2, 3], lambda m: {1: answer_with(good), 2: answer_with(b"x" * 3)}
                        .get(m.metadata.dst_node_id, lambda _: None)(m), node_keys=False)
    assert keys.learn(grid, [1, 2, 3]) == [1]  # 2's key is no key, 3 never answers
    assert [m.metadata.message_type for m in grid.calls[0]] == [NODE_KEY_QUERY] * 3
    assert keys.of(1) == good and keys.of(2) is None
    assert keys.learn(grid, [1]) == [1] and len(grid.calls) == 1  # known: not asked again
    keys.forget([1])
    keys.learn(grid, [1])
    assert len(grid.calls) == 2


def test_a_node_that_sends_another_nodes_key_gets_no_session(task_identity):
    keys = NodeKeys(timeout_s=5)
    alice = public_key_of(ALICE)
    grid = ScriptedGrid([1, 2], answer_with(alice), node_keys=False)
    assert keys.learn(grid, [1, 2]) == [1]  # node 2 copied node 1's key
    assert keys.of(2) is None and keys.of(1) == alice


def test_the_client_app_keeps_one_key_per_node_for_the_run(task_identity):
    grid = LocalGrid(build_client_app(), num_nodes=2)
    keys = NodeKeys(timeout_s=5)
    assert keys.learn(grid, [1, 2]) == [1, 2]
    first = {n: keys.of(n) for n in (1, 2)}
    assert first[1] != first[2]
    keys.forget([1, 2])
    keys.learn(grid, [1, 2])
    assert {n: keys.of(n) for n in (1, 2)} == first  # context.state kept each node's pair


def test_node_keys_are_on_under_flwr_run_unless_set_off_and_off_in_experiments_run(tmp_path):
    run_dir = str(tmp_path)
    assert deployed_config({"overrides": "logger=none", "run-dir": run_dir}
                           ).dataplane.node_keys is True
    assert deployed_config({"overrides": "logger=none dataplane.node_keys=false",
                            "run-dir": run_dir}).dataplane.node_keys is False
    assert small_config().dataplane.node_keys is None  # experiments.run: off
