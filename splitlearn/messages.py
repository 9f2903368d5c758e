"""The control plane's vocabulary: message keys and record encoders both sides use.

The only module of ``splitlearn`` that imports Flower. Data-plane frames are
:mod:`splitlearn.dataplane`'s; this is what travels in Flower messages: device-side
weights as ``ArrayRecord`` objects keyed like state dicts, and the records the
ServerApp's strategies and the ClientApp read from each other, by these keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

#: Message record of the round's data (round, cut and, for split protocols, the session).
ROUND_KEY = "round"
#: ``round`` record entry saying whether the device recomputes its activations in the
#: backward (``planner.recompute``), echoed in its reply's metrics. The string keeps its
#: older name: devices outside this repository read it (docs/reference/trunk-proto.md).
RECOMPUTE_KEY = "checkpoint"
#: ``config`` record entry of the run's spec (``splitlearn.config.encode_spec``).
SPEC_KEY = "run-spec"
#: Reply record of a device that did not finish: ``status`` and ``reason``.
STATUS_KEY = "status"
#: Reply metric a device that clipped its update reports as 1: DP-FedAvg's uniform weight.
UPDATE_WEIGHT_KEY = "update-weight"
#: Reply key of the ArrayRecord that carries a round's smashed data in the Flower reply.
SMASHED_RECORD_KEY = "smashed"
#: Reply record of the preset a real device declared (``clients.connect --profile``),
#: ``{"name": PRESET}``: its ``clients.csv`` row's ``profile``.
DECLARED_PROFILE_RECORD = "device-profile"


def state_to_record(state: Mapping[str, torch.Tensor]) -> Any:
    """Wrap a state dict (parameters and buffers) in a Flower ``ArrayRecord``."""
    from flwr.app import ArrayRecord

    return ArrayRecord({k: v.detach().cpu() for k, v in state.items()})


def record_to_state(record: Any) -> dict[str, torch.Tensor]:
    """Unwrap a Flower ``ArrayRecord`` into a state dict of tensors."""
    return {k: torch.from_numpy(np.array(v.numpy())) for k, v in record.items()}


def record_bytes(record: Any) -> int:
    """Bytes of an ``ArrayRecord``'s arrays."""
    return sum(len(array.data) for array in record.values())


def stages_outside(record: Any, start: int, end: int) -> Any:
    """Return an ``ArrayRecord`` keyed ``"<stage index>.…"`` without stages ``[start, end)``."""
    from flwr.app import ArrayRecord

    return ArrayRecord({
        k: v for k, v in record.items() if not start <= int(k.partition(".")[0]) < end
    })


def with_dtypes_of(record: Any, reference: Any) -> Any:
    """Return ``record`` with each array cast to ``reference``'s dtype (integers rounded)."""
    from flwr.app import Array, ArrayRecord

    arrays = {}
    for key, array in record.items():
        values, dtype = array.numpy(), reference[key].numpy().dtype
        if np.issubdtype(dtype, np.integer):
            values = np.rint(values)
        arrays[key] = Array(np.asarray(values).astype(dtype, copy=False))
    return ArrayRecord(arrays)


def unpack_smashed(arrays: Mapping[str, Tensor]) -> list[tuple[Tensor, Tensor]]:
    """Split a reply's smashed data back into its batches (structure only; values unchecked).

    Raises
    ------
    ValueError
        If a tensor is missing or the batch sizes do not add up to the rows.
    """
    missing = sorted({"activations", "labels", "batch-sizes"} - set(arrays))
    if missing:
        raise ValueError(f"smashed payload lacks {missing}")
    acts, labels = arrays["activations"], arrays["labels"]
    counts = [int(n) for n in arrays["batch-sizes"].reshape(-1).tolist()]
    if any(n <= 0 for n in counts) or sum(counts) != len(acts) or len(labels) != len(acts):
        raise ValueError(
            f"smashed payload: batch sizes sum to {sum(counts)} (all must be > 0) for "
            f"{len(acts)} activation rows and {len(labels)} labels"
        )
    return list(zip(acts.split(counts), labels.split(counts), strict=True))
