"""What each device runtime can train, beyond the protocol's own capabilities.

A device runs its step eagerly in PyTorch (``devices.runtime=eager``, everything), or
through an exported ExecuTorch program (``executorch``): the split step's device side
without privacy that clips, noises or regularises, without activation recomputation,
and without buffers the program would not update. A phone runs it in its browser
(``web``, :mod:`splitlearn.web`): the split and U-shaped steps on dense float32 frames,
releasing clipped and noised activations where asked, without DP-SGD, NoPeek, gradient
noise or activation recomputation, on the layers the web runtime declares. Which
protocols' device steps a runtime can run at all is each protocol's capability
(``Capabilities.runtimes``);
these are the refusals that depend on the run's other settings and on the model.
"""

from __future__ import annotations

from torch import nn

from splitlearn.config import CompressionConfig, PrivacyConfig

#: The setting every ExecuTorch refusal names.
EXECUTORCH_KEY = "devices.runtime=executorch"
#: ... and every web refusal.
WEB_KEY = "devices.web=true"
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


def web_refusal(privacy: PrivacyConfig, compression: CompressionConfig, *,
                recompute: bool) -> str | None:
    """Return why a phone's web runtime cannot train this run's device step (None: it can).

    Parameters
    ----------
    privacy : PrivacyConfig
        The device's privacy settings: the runtime releases clipped and noised activations
        (``activation_gaussian``), not DP-SGD, NoPeek or noised returned gradients.
    compression : CompressionConfig
        The data plane's encodings: the runtime reads and writes dense float32 frames.
    recompute : bool
        Whether the device may be asked to recompute its activations (the runtime's
        memory is TensorFlow.js's own).
    """
    if privacy.name not in ("none", "activation_gaussian"):
        return (f"{WEB_KEY} with privacy={privacy.name}: the web runtime has no per-example "
                "gradients (use privacy=activation_gaussian or none)")
    if privacy.nopeek_weight or privacy.gradient_noise_multiplier:
        return (f"{WEB_KEY} with privacy.nopeek_weight={privacy.nopeek_weight}, "
                f"gradient_noise_multiplier={privacy.gradient_noise_multiplier}: the web runtime "
                "neither regularises what it sends nor noises the gradient it returns")
    if compression.uplink != "none" or compression.downlink != "none":
        return (f"{WEB_KEY} with dataplane.compression (uplink={compression.uplink!r}, "
                f"downlink={compression.downlink!r}): the web runtime sends and reads dense "
                "float32 frames (use compression=none)")
    if recompute:
        return (f"{WEB_KEY} with activation recomputation: the page's memory is TensorFlow.js's "
                "(use planner.recompute=false)")
    return None
