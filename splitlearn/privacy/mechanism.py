"""Clip-and-noise of smashed data: what a client releases instead of raw activations.

Every sample's activation is flattened, scaled down to an L2 norm of at most
``clip_norm`` (C) and released with independent Gaussian noise of standard
deviation ``noise_multiplier * clip_norm`` (sigma * C) per coordinate. The
operation is differentiable in the activations (noise is an additive constant),
so a client sends ``released.detach()`` and finishes its backward pass with
``released.backward(grad)``: the gradient flows back through the clipping.

Replacing one sample's input by any other moves its clipped activation by at most
``2 * C`` in L2 (both lie in the ball of radius C), so one released row is a
Gaussian mechanism with sensitivity ``2C`` and noise ``sigma * C``: its noise
multiplier relative to the sensitivity is ``sigma / 2``
(:attr:`GaussianActivationMechanism.accounting_noise_multiplier`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

#: Added to per-sample norms before dividing (as Opacus does for gradients).
NORM_EPS = 1e-6


def batch_coupled_modules(module: nn.Module) -> list[str]:
    """Names of the submodules whose training-mode output row mixes the whole batch.

    BatchNorm normalises each row with the batch's mean and variance, so one
    example's input moves every row of the batch: a per-row clip and noise then
    no longer bound what a row reveals about one example, and the accounting,
    which charges one release per example, does not hold.
    """
    return [name or type(module).__name__ for name, m in module.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def per_sample_norms(x: Tensor) -> Tensor:
    """L2 norm of each sample of a batch, over all its other dimensions.

    Parameters
    ----------
    x : Tensor
        Batch of shape ``(B, ...)``.

    Returns
    -------
    Tensor
        Shape ``(B,)``.
    """
    return x.reshape(len(x), -1).norm(2, dim=1)


def clip_per_sample(x: Tensor, *, max_norm: float) -> Tensor:
    """Scale each sample of ``x`` so that its flattened L2 norm is at most ``max_norm``.

    Samples already inside the ball are left unchanged; the operation is
    differentiable (the scale factor depends on ``x``).

    Parameters
    ----------
    x : Tensor
        Batch of shape ``(B, ...)``.
    max_norm : float
        Clipping bound C (> 0).

    Returns
    -------
    Tensor
        Same shape as ``x``; every sample's norm is ``<= max_norm``.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
    factor = (max_norm / (per_sample_norms(x) + NORM_EPS)).clamp(max=1.0)
    return x * factor.reshape(-1, *([1] * (x.dim() - 1)))


class GaussianActivationMechanism:
    """Per-sample L2 clipping to C, then Gaussian noise of std sigma * C.

    Parameters
    ----------
    clip_norm : float
        C, the per-sample L2 bound of the released activations (> 0).
    noise_multiplier : float
        sigma (>= 0); the noise std per coordinate is ``sigma * C``.
    generator : torch.Generator, optional
        Source of the noise. The noise must stay secret from the receiver: a
        generator seeded from anything the server knows lets it subtract the
        noise. None uses torch's global generator.
    """

    def __init__(
        self,
        *,
        clip_norm: float,
        noise_multiplier: float,
        generator: torch.Generator | None = None,
    ) -> None:
        if not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {clip_norm!r}")
        if not noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}")
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.generator = generator

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise per coordinate (sigma * C)."""
        return self.noise_multiplier * self.clip_norm

    @property
    def sensitivity(self) -> float:
        """L2 distance between two possible released means of one sample (2C)."""
        return 2.0 * self.clip_norm

    @property
    def accounting_noise_multiplier(self) -> float:
        """Noise std over sensitivity (sigma / 2): what an RDP accountant needs per row."""
        return self.noise_std / self.sensitivity

    def __call__(self, activations: Tensor) -> Tensor:
        """Return the released activations: clipped per sample, plus noise.

        Parameters
        ----------
        activations : Tensor
            Batch of shape ``(B, ...)``; gradients flow back through the clip.

        Returns
        -------
        Tensor
            Same shape and dtype as ``activations``.
        """
        clipped = clip_per_sample(activations, max_norm=self.clip_norm)
        if self.noise_multiplier == 0:
            return clipped
        noise = torch.randn(
            activations.shape, generator=self.generator, dtype=activations.dtype,
            device=activations.device,
        )
        return clipped + noise * self.noise_std

    def __repr__(self) -> str:
        return (
            f"GaussianActivationMechanism(clip_norm={self.clip_norm}, "
            f"noise_multiplier={self.noise_multiplier})"
        )
