"""A node's privacy ledger on disk: round trip, atomic writes, no silent reset."""

from __future__ import annotations

import os

import pytest

from splitlearn.privacy import PrivacyAccountant
from splitlearn.privacy.ledger import load_ledger, save_ledger


def spent() -> PrivacyAccountant:
    accountant = PrivacyAccountant()
    accountant.step(noise_multiplier=0.5, sample_rate=1.0, num_steps=2)
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=3)
    return accountant


def test_a_ledger_round_trips_and_starts_empty(tmp_path):
    path = tmp_path / "node" / "digits.json"  # its folder is made on first write
    assert load_ledger(path).history == []
    save_ledger(path, spent())
    assert load_ledger(path).history == spent().history
    assert load_ledger(path).epsilon(1e-5) == pytest.approx(spent().epsilon(1e-5))
    assert os.listdir(path.parent) == ["digits.json"]  # no temporary file left


@pytest.mark.parametrize("text", ["", "{not json", '{"version": 2, "history": {}}',
                                  '{"version": 1}', '{"version": 1, "history": {"num-steps": []}}',
                                  "[1, 2]"])
def test_an_unreadable_ledger_is_an_error_not_a_reset(tmp_path, text):
    path = tmp_path / "ledger.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="unreadable"):
        load_ledger(path)


def test_a_write_that_fails_leaves_the_previous_ledger(tmp_path, monkeypatch):
    path = tmp_path / "ledger.json"
    first = PrivacyAccountant()
    first.step(noise_multiplier=0.5, sample_rate=1.0)
    save_ledger(path, first)

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        save_ledger(path, spent())
    monkeypatch.undo()
    assert load_ledger(path).history == first.history
    assert os.listdir(tmp_path) == ["ledger.json"]
