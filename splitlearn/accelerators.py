"""Where the trunk computes (``server.device``) and in what precision (``server.precision``).

The trunk's model, optimiser state and steps live on the device; frames are decoded on
the host, and the trunk moves each batch there and its answer back
(:meth:`server.trunk.Trunk.run`). With ``bf16`` the forward runs under
``torch.autocast`` to bfloat16: the weights, the optimiser's state, the loss and the
gradient at the cut stay float32, so the devices see the same wire format.
"""

from __future__ import annotations

import contextlib

import torch

#: The setting every refusal here names.
DEVICE_KEY = "server.device"


def resolve_device(name: str) -> torch.device:
    """Return the torch device ``server.device=name`` means on this machine.

    ``auto`` is the first CUDA device, else Apple's MPS, else the CPU.

    Raises
    ------
    ValueError
        Naming the key: this machine lacks the device (no CUDA, an index past the last
        CUDA device, no MPS), or the name is not one of the accepted ones.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        return torch.device("mps") if _has_mps() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps":
        if not _has_mps():
            raise ValueError(f"{DEVICE_KEY}=mps: this machine has no MPS device "
                             "(torch.backends.mps.is_available() is False); use auto or cpu")
        return torch.device("mps")
    suffix = name.removeprefix("cuda:")
    if name == "cuda" or (name.startswith("cuda:") and suffix.isdigit()):
        index = 0 if name == "cuda" else int(suffix)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{DEVICE_KEY}={name}: this machine has no CUDA device "
                             f"(torch {torch.__version__}, torch.cuda.is_available() is False); "
                             "use auto or cpu")
        if index >= count:
            raise ValueError(f"{DEVICE_KEY}={name}: this machine has {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")
        return torch.device("cuda", index)
    raise ValueError(f"{DEVICE_KEY}={name!r}; accepted: auto, cpu, cuda, cuda:N, mps")


def _has_mps() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[None]:
    """Return the context the trunk's forward runs in (a no-op for ``fp32``).

    Raises
    ------
    ValueError
        ``precision`` is not ``fp32`` or ``bf16``.
    """
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    raise ValueError(f"server.precision={precision!r}; accepted: fp32, bf16")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing a step on an accelerator needs it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()

