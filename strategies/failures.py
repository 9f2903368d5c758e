"""Which replies count: failed, unavailable, vanished, out-of-memory and late clients.

Shared by every strategy: a reply counts only if the client finished and, when a
round deadline is set, finished in time on its (virtual) device. Everything else
is recorded with its cause and left out of aggregation, so nothing of a
client's partial work reaches the aggregated weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import Message, MetricRecord

from splitlearn.task import STATUS_KEY

#: Causes a client reports as ``[kind] message`` (see clients/device.py).
FAILURE_KINDS = ("unavailable", "dropout", "memory")
_TAG = re.compile(r"\[(" + "|".join(FAILURE_KINDS) + r")\]")


def reply_metrics(reply: Message) -> MetricRecord:
    """Return the (single) MetricRecord of a reply."""
    return next(iter(reply.content.metric_records.values()))


def reply_status(reply: Message, *, deadline_s: float | None) -> str:
    """``ok``, ``straggler``, one of :data:`FAILURE_KINDS`, or ``failed``."""
    if reply.has_error():
        match = _TAG.search(reply.error.reason)
        return match.group(1) if match else "failed"
    declined = reply.content.config_records.get(STATUS_KEY)
    if declined is not None:
        return str(declined["status"])
    if deadline_s is not None and float(reply_metrics(reply).get("virtual-s", 0.0)) > deadline_s:
        return "straggler"
    return "ok"


def client_row(reply: Message, status: str) -> dict[str, Any]:
    """Build the per-client table row for ``reply``."""
    node = str(reply.metadata.src_node_id)
    row: dict[str, Any] = {"client": node, "node_id": node, "status": status}
    if reply.has_error():
        match = _TAG.search(reply.error.reason)
        reason = reply.error.reason[match.start():] if match else reply.error.reason
        return row | {"reason": reason.strip().splitlines()[0][:200]}
    if (declined := reply.content.config_records.get(STATUS_KEY)) is not None:
        row["reason"] = str(declined["reason"])
    metrics: Mapping[str, Any] = reply_metrics(reply)
    # Partition ids are short and stable across runs; node ids are neither.
    if "partition-id" in metrics:
        row["partition_id"] = int(metrics["partition-id"])
        row["client"] = str(row["partition_id"])
    return row | {k.replace("-", "_"): v for k, v in metrics.items() if k != "partition-id"}


def status_counts(statuses: Iterable[str]) -> dict[str, int]:
    """Count replies per status, listing every status (zeros included)."""
    counts = dict.fromkeys(("ok", "straggler", *FAILURE_KINDS, "failed"), 0)
    for status in statuses:
        counts[status] += 1
    return counts
