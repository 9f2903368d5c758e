"""A node's privacy spend on its own disk, so a restart or a new run continues from it.

Flower keeps ``context.state`` in the SuperNode's memory: a restarted node, or a
new run, would start again at epsilon = 0 and release the same examples under a
fresh budget. A node whose config names a ledger file (node config
``privacy-ledger``, one file per local dataset: the spend belongs to the data,
not to a run) loads its accountant from it and writes it back after every
charge, before anything leaves the device.

Writes are atomic (a temporary file in the same folder, flushed to disk, then
renamed over the old one), so a crash while writing leaves the previous ledger
intact. A ledger that exists but cannot be read is an error, never a reset.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from splitlearn.atomic import write_atomic
from splitlearn.privacy.accounting import PrivacyAccountant

#: Node-config key of the ledger file.
LEDGER_KEY = "privacy-ledger"
#: Format version written into every ledger.
LEDGER_VERSION = 1


def load_ledger(path: str | Path) -> PrivacyAccountant:
    """Return the accountant kept at ``path`` (empty when the file does not exist yet).

    Raises
    ------
    ValueError
        If the file exists but is not a ledger this code wrote (the spend is
        unknown, so the node must not go on as if it were zero).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return PrivacyAccountant()
    try:
        data = json.loads(text)
        if data.get("version") != LEDGER_VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {LEDGER_VERSION}")
        return PrivacyAccountant.from_lists(data["history"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"privacy ledger {path} is unreadable ({err}); refusing to assume "
                         "nothing was spent") from err


def save_ledger(path: str | Path, accountant: PrivacyAccountant) -> None:
    """Write ``accountant`` to ``path`` atomically (the old ledger stays if this fails)."""
    write_atomic(path, json.dumps({"version": LEDGER_VERSION, "history": accountant.to_lists()}))


def label_secret_path(ledger: str | Path) -> Path:
    """Where the node keeps the secret its labels are randomised with, beside its ledger."""
    return Path(f"{ledger}.label-secret")


def load_label_secret(ledger: str | Path) -> int:
    """Return the node's label secret kept beside ``ledger``, creating it on first use.

    Raises
    ------
    ValueError
        If the file exists but holds no secret (a new one would draw new labels:
        the same labels released twice under two draws).
    """
    path = label_secret_path(ledger)
    try:
        text = path.read_text()
    except FileNotFoundError:
        secret = secrets.randbits(63)
        write_atomic(path, json.dumps({"version": LEDGER_VERSION, "secret": secret}))
        return secret
    try:
        return int(json.loads(text)["secret"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"label secret {path} is unreadable ({err}); refusing to draw the "
                         "labels anew") from err
