"""Label DP by randomised response: the mechanism against its definition, and the node's secret."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import Context, RecordDict
from hypothesis import given
from hypothesis import strategies as st

from clients.app import LABEL_SECRET_STATE_KEY, _label_secret
from splitlearn.config import PrivacyConfig
from splitlearn.privacy.floor import PrivacyFloor, PrivacyFloorViolation
from splitlearn.privacy.labels import (
    keep_probability,
    randomized_labels,
    randomized_response,
    transition_matrix,
)
from splitlearn.privacy.ledger import label_secret_path, load_label_secret


@given(epsilon=st.floats(0.01, 30), classes=st.integers(2, 100))
def test_every_output_is_at_most_e_to_the_epsilon_likelier_under_one_label_than_another(
        epsilon, classes):
    matrix = transition_matrix(epsilon, classes)
    torch.testing.assert_close(matrix.sum(1), torch.ones(classes, dtype=torch.float64))
    # The worst ratio over true labels a, b and outputs o of P(o | a) / P(o | b) is e^eps.
    ratio = float((matrix.max(0).values / matrix.min(0).values).max())
    assert ratio == pytest.approx(math.exp(epsilon), rel=1e-9)


def test_draws_follow_the_transition_matrix():
    epsilon, classes, n = 1.0, 10, 200_000
    true = torch.arange(n) % classes
    released = randomized_response(true, epsilon=epsilon, num_classes=classes,
                                   generator=torch.Generator().manual_seed(0))
    kept = float((released == true).float().mean())
    assert kept == pytest.approx(keep_probability(epsilon, classes), abs=0.005)
    # A changed label is uniform over the other classes.
    changed = released[(true == 3) & (released != true)]
    counts = torch.bincount(changed, minlength=classes).double()
    assert counts[3] == 0
    others = counts[torch.arange(classes) != 3]
    assert float(others.max() / others.min()) < 1.1


def test_the_same_secret_draws_the_same_labels_and_another_does_not():
    labels = torch.arange(500) % 10
    a = randomized_labels(labels, epsilon=1.0, num_classes=10, secret=7)
    assert torch.equal(a, randomized_labels(labels, epsilon=1.0, num_classes=10, secret=7))
    assert not torch.equal(a, randomized_labels(labels, epsilon=1.0, num_classes=10, secret=8))


@pytest.mark.parametrize(("call", "message"), [
    (lambda: keep_probability(0.0, 10), "label epsilon must be a finite number > 0"),
    (lambda: keep_probability(math.inf, 10), "label epsilon must be a finite number > 0"),
    (lambda: keep_probability(1.0, 1), "at least 2 classes"),
    (lambda: randomized_response(torch.tensor([0, 10]), epsilon=1.0, num_classes=10,
                                 generator=torch.Generator()), "labels span 0..10"),
    (lambda: PrivacyConfig(label_epsilon=-1.0), "privacy.label_epsilon must be"),
])
def test_bad_settings_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_large_epsilon_keeps_nearly_every_label_without_overflow():
    assert keep_probability(1e4, 10) == pytest.approx(1.0)


def context(node_config: dict) -> Context:
    return Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(),
                   run_config={})


def test_a_node_keeps_its_secret_across_rounds_and_beside_its_ledger_across_restarts(tmp_path):
    node = context({})
    secret = _label_secret(node)
    assert _label_secret(node) == secret  # the next round: the same draw
    assert LABEL_SECRET_STATE_KEY in node.state.config_records
    assert _label_secret(context({})) != secret  # another node (or a restart without a ledger)
    ledger = tmp_path / "node.json"
    first = _label_secret(context({"privacy-ledger": str(ledger)}))
    assert label_secret_path(ledger).is_file()
    assert _label_secret(context({"privacy-ledger": str(ledger)})) == first  # restarted
    label_secret_path(ledger).write_text("{not json")
    with pytest.raises(ValueError, match="refusing to draw the labels anew"):
        load_label_secret(ledger)


def test_a_node_can_require_label_privacy():
    floor = PrivacyFloor.from_node_config({"privacy-label-epsilon-max": "2"})
    floor.check(PrivacyConfig(label_epsilon=1.0))
    with pytest.raises(PrivacyFloorViolation, match="no label privacy"):
        floor.check(PrivacyConfig())
    with pytest.raises(PrivacyFloorViolation, match="label_epsilon=4.0; this node accepts at most"):
        floor.check(PrivacyConfig(label_epsilon=4.0))
    with pytest.raises(ValueError, match="privacy-label-epsilon-max"):
        PrivacyFloor.from_node_config({"privacy-label-epsilon-max": 0})
