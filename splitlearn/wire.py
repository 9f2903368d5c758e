"""Tensors in Flower records (the only module of ``splitlearn`` that imports Flower).

Data-plane frames are :mod:`splitlearn.dataplane`'s; this is the control plane:
client-side weights travel as ``ArrayRecord`` objects keyed like state dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


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
