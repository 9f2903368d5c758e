"""The link between a phone's ClientApp and its phone, through the gateway (no PyTorch here).

A phone in a browser is a Flower node through the gateway (:mod:`clients.gateway`): the
gateway runs one SuperNode per phone, whose node config says the node is a phone
(:data:`RUNTIME_KEY` ``web``) and where its phone is (:data:`RELAY_KEY`, :data:`SLOT_KEY`,
:data:`SECRET_KEY`). Each message's ClientApp hands the round to the phone over this link
and waits for its result: one WebSocket to the gateway (on 127.0.0.1), a hello naming the
slot with the gateway's secret, one task as JSON, then progress and one result or failure.

The gateway's answers, one JSON object per text frame:

``{"holds": id}``
    The answer to the hello: the id of the data the slot's phone holds (null: none). A
    task for a phone that holds its data leaves the rows out. An id ``own:<n>:<hash>`` is
    the person's own ``n`` labelled pictures, which never leave the phone. A hello with
    ``"ask": "holds"`` gets only this answer (:func:`holding`).
``{"progress": {...}}``
    The phone's batches so far (read for the timeout, not needed).
``{"result": {...}}``
    The phone's trained state and measurements (:mod:`clients.steps.web` reads them).
``{"failed": reason, "kind": kind}``
    The phone could not finish: ``unavailable`` (no phone holds the slot when the round
    starts), ``lost`` (it left mid-round), ``failed`` (the page refused the task).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

#: Node-config key of the runtime this node's device step runs in: ``web`` for a phone.
RUNTIME_KEY = "device-runtime"
#: The runtime of a phone's browser.
WEB_RUNTIME = "web"
#: Node-config keys of the gateway's relay URL, the node's slot there, and the secret
#: the gateway accepts relays with (the SuperNode's node config, seen only on its host).
RELAY_KEY = "web-relay"
SLOT_KEY = "web-slot"
SECRET_KEY = "web-secret"
#: Longest a JSON frame of the link may be: a task carries the stages and, the first
#: time, the phone's data.
MAX_FRAME_BYTES = 256 * 2**20


class PhoneFailed(Exception):
    """The phone did not finish the round; ``kind`` is the reply status it becomes."""

    def __init__(self, reason: str, kind: str = "failed") -> None:
        super().__init__(reason)
        self.kind = kind


def holding(url: str, *, slot: int, secret: str, timeout_s: float = 10.0) -> str | None:
    """Return the id of the data the phone of ``slot`` holds now (None: none yet).

    Raises
    ------
    PhoneFailed
        The gateway cannot be reached, or no phone holds the slot (``unavailable``).
    """
    try:
        with connect(url, open_timeout=timeout_s, close_timeout=2) as link:
            link.send(json.dumps({"slot": slot, "secret": secret, "ask": "holds"}))
            answer = json.loads(link.recv(timeout=timeout_s))
    except (OSError, TimeoutError, ConnectionClosed) as err:
        raise PhoneFailed(f"the gateway at {url} did not answer ({err})", "lost") from err
    if "failed" in answer:
        raise PhoneFailed(str(answer["failed"]), str(answer.get("kind", "failed")))
    held = answer.get("holds")
    return None if held is None else str(held)


def delegate(url: str, *, slot: int, secret: str,
             task: Callable[[str | None], dict[str, Any]], timeout_s: float) -> dict[str, Any]:
    """Hand the task to the phone of ``slot`` and return its result.

    Parameters
    ----------
    url : str
        The gateway's relay URL (node config :data:`RELAY_KEY`).
    slot, secret : int, str
        The node's slot and the gateway's secret (node config).
    task : callable
        Builds what the phone trains (see :mod:`clients.steps.web`) from the id of the
        data the phone holds (None: none), so that rows it holds do not travel again.
    timeout_s : float
        Longest the round may take; then the phone counts as lost.

    Raises
    ------
    PhoneFailed
        The gateway cannot be reached, no phone holds the slot, the phone left or refused.
    """
    deadline = time.monotonic() + timeout_s
    try:
        with connect(url, max_size=MAX_FRAME_BYTES, open_timeout=10,
                     close_timeout=2) as link:
            link.send(json.dumps({"slot": slot, "secret": secret}))
            while True:
                answer = json.loads(link.recv(timeout=max(deadline - time.monotonic(), 0.0)))
                if "holds" in answer:
                    held = answer["holds"]
                    link.send(json.dumps(task(None if held is None else str(held))))
                elif "result" in answer:
                    return dict(answer["result"])
                if "failed" in answer:
                    raise PhoneFailed(str(answer["failed"]), str(answer.get("kind", "failed")))
    except TimeoutError as err:
        raise PhoneFailed(f"the phone did not finish within {timeout_s:.0f} s", "lost") from err
    except (OSError, ConnectionClosed) as err:
        raise PhoneFailed(f"the gateway at {url} closed the relay ({err})", "lost") from err
