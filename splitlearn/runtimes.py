"""What each device runtime can train, beyond the protocol's own capabilities.

A device runs its step eagerly in PyTorch (``devices.runtime=eager``, everything), or
through an exported ExecuTorch program (``executorch``): the split step's device side
without privacy that clips, noises or regularises, without activation recomputation,
and without buffers the program would not update. Which protocols' device steps a
runtime can run at all is each protocol's capability (``Capabilities.runtimes``);
these are the refusals that depend on the run's other settings and on the model.
"""

from __future__ import annotations

from torch import nn

from splitlearn.config import PrivacyConfig

#: The setting every ExecuTorch refusal names.
EXECUTORCH_KEY = "devices.runtime=executorch"
RECOMPUTE_REFUSAL = (f"{EXECUTORCH_KEY} with activation recomputation: the program's memory "
                     "is ExecuTorch's plan (use planner.recompute=false or "
                     "devices.runtime=eager)")


def executorch_refusal(privacy: PrivacyConfig, *, recompute: bool) -> str | None:
    """Return why ExecuTorch's runtime cannot train a split device side (None: it can).

    Parameters
    ----------
    privacy : PrivacyConfig
        The device's privacy settings.
    recompute : bool
        Whether the device may be asked to recompute its activations.
    """
    if privacy.name != "none":
        return (f"{EXECUTORCH_KEY} with privacy={privacy.name}: the exported program neither "
                "clips nor noises (use privacy=none or devices.runtime=eager)")
    if privacy.nopeek_weight:
        return (f"{EXECUTORCH_KEY} with privacy.nopeek_weight={privacy.nopeek_weight}: the "
                "exported program has no NoPeek term (use devices.runtime=eager)")
    return RECOMPUTE_REFUSAL if recompute else None


def bottom_refusal(bottom: nn.Module) -> str | None:
    """Return why the exported program cannot train ``bottom`` (None: it can)."""
    buffers = [name for name, _ in bottom.named_buffers()]
    if buffers:
        return (f"{EXECUTORCH_KEY}: the device's stages hold buffers {buffers[:3]} (e.g. "
                "BatchNorm's running statistics), which the exported program does not "
                "update (use devices.runtime=eager or another cut)")
    return None
