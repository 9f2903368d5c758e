"""The registry: every protocol, listed once.

Each protocol is declared in its own module of this package (its options schema and
its :class:`~protocols.spec.Protocol` entry, capabilities included); adding one means
writing that module, its parts and its yaml, and one line here.
"""

from __future__ import annotations

from protocols import fedavg, local_loss, sequential, sglr, splitfed, ushaped
from protocols.spec import Protocol

#: Every protocol, by name.
PROTOCOLS: dict[str, Protocol] = {p.name: p for p in (
    fedavg.FEDAVG, splitfed.SPLITFED_V2, splitfed.SPLITFED_V1, sequential.SEQUENTIAL,
    ushaped.USHAPED, local_loss.LOCAL_LOSS, sglr.SGLR,
)}


def protocol_named(name: str) -> Protocol:
    """Return the registered protocol ``name`` (ValueError naming the accepted ones)."""
    if name not in PROTOCOLS:
        raise ValueError(f"strategy.name={name!r}; accepted: {sorted(PROTOCOLS)}")
    return PROTOCOLS[name]


def runtime_refusal(protocol: Protocol, runtime: str) -> str | None:
    """Return why ``devices.runtime=runtime`` cannot run the device step (None: it can)."""
    if runtime in protocol.capabilities.runtimes:
        return None
    accepted = sorted(p.name for p in PROTOCOLS.values() if runtime in p.capabilities.runtimes)
    return (f"devices.runtime={runtime} runs the device step of {accepted}; "
            f"strategy={protocol.name} has another device step (use devices.runtime=eager)")
