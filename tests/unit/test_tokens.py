"""Session tokens: issued, adopted by another registry (a trunk worker's), revoked."""

from __future__ import annotations

from splitlearn.dataplane import TokenRegistry


def test_an_adopted_grant_is_valid_until_revoked_and_revocation_tells_the_listeners():
    issuer, worker = TokenRegistry(), TokenRegistry()
    token = issuer.issue(client="7", protocol="splitfed_v2", cut=1, server_round=3, ttl_s=60)
    assert worker.lookup(token) is None  # another registry knows nothing of it
    worker.adopt(token, issuer.lookup(token))
    assert worker.lookup(token) == issuer.lookup(token)
    heard: list[list[str]] = []
    worker.on_revoke(heard.append)
    worker.revoke([token, "never-issued"])
    assert worker.lookup(token) is None and issuer.lookup(token) is not None
    assert heard == [[token, "never-issued"]]


def test_revoking_a_round_revokes_it_and_older_rounds_only():
    tokens = TokenRegistry()
    old, current, later = (tokens.issue(client="1", protocol="p", cut=1, server_round=r, ttl_s=60)
                           for r in (1, 2, 3))
    heard: list[list[str]] = []
    tokens.on_revoke(heard.append)
    tokens.revoke_round(2)
    assert tokens.lookup(old) is None and tokens.lookup(current) is None
    assert tokens.lookup(later) is not None
    assert sorted(heard[0]) == sorted([old, current])


def test_an_expired_adopted_grant_is_refused():
    issuer, worker = TokenRegistry(), TokenRegistry()
    token = issuer.issue(client="7", protocol="p", cut=1, server_round=1, ttl_s=-1)
    grant = issuer._grants[token]  # expired at issue; lookup would hide it
    worker.adopt(token, grant)
    assert worker.lookup(token) is None
