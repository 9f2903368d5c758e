"""DP-SGD on the client-side layers, driven by the gradient the trunk returns.

The client's backward pass starts at the cut with the trunk's gradient
``d(mean loss)/d(activations)`` (the trunk averages cross-entropy over the
batch), not at a local loss. Opacus's :class:`~opacus.GradSampleModule` hooks
capture each layer's activations in the forward and the backpropagated
gradients in ``activations.backward(grad)``, so per-sample gradients come out
of that external gradient exactly as from a local loss. ``loss_reduction="mean"``
matches what the trunk sends: the hooks multiply the backprops by the batch
size to undo the trunk's ``1/B`` before clipping, and :class:`DPOptimizer`
divides the noisy sum by ``expected_batch_size``.

Batches are Poisson-sampled (each local example joins each step independently
with probability ``sample_rate``), the sampling Opacus's RDP accountant
assumes. A step whose sample is empty still takes a noise-only update: skipping
it would reveal that the batch was empty.
"""

from __future__ import annotations

import warnings

import torch
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn

from splitlearn.config import OptimizerConfig
from splitlearn.optim import make_optimizer


class ExternalGradDPOptimizer(DPOptimizer):
    """Opacus's DPOptimizer whose step also works after an empty batch (noise only)."""

    def pre_step(self, closure=None):  # noqa: ANN001, ANN201 (Opacus's signature)
        """Treat 'no per-sample gradients at all' as a batch of zero samples, then step."""
        params = self.params
        if params and all(getattr(p, "grad_sample", None) is None for p in params):
            for p in params:
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        return super().pre_step(closure)


class DPSGDBottom:
    """Per-sample gradient clipping and Gaussian noise for the client-side layers.

    Hooks ``bottom`` in place; call :meth:`close` after training to remove them.

    Parameters
    ----------
    bottom : nn.Module
        Client-side layers (every trainable layer must be one Opacus supports:
        no BatchNorm).
    lr, momentum, weight_decay : float
        The inner optimiser's settings (momentum for SGD only).
    optimizer : OptimizerConfig, optional
        The inner optimiser Opacus wraps (None: SGD).
    noise_multiplier : float
        sigma; the noise std added to the sum of clipped gradients is ``sigma * C``.
    max_grad_norm : float
        C, the per-sample gradient L2 bound (over all parameters of ``bottom``).
    expected_batch_size : float
        ``sample_rate * num_examples``; the noisy sum is divided by it.
    generator : torch.Generator, optional
        Noise source (keep it secret from the server); None uses torch's global one.
    """

    def __init__(
        self,
        bottom: nn.Module,
        *,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        optimizer: OptimizerConfig | None = None,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
        generator: torch.Generator | None = None,
    ) -> None:
        if not expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size!r}")
        # The first layer's input needs no gradient, so torch warns on every backward
        # that its full backward hook sees output gradients only: all Opacus reads.
        warnings.filterwarnings(
            "ignore", message="Full backward hook is firing when gradients are computed with "
            "respect to module outputs since no inputs require gradients", category=UserWarning,
        )
        try:
            self.module = GradSampleModule(bottom, loss_reduction="mean", strict=True)
        except NotImplementedError as err:
            raise ValueError(
                f"privacy=dpsgd_client needs per-sample gradients of every client-side layer; "
                f"Opacus refuses this model: {err}"
            ) from err
        inner = make_optimizer(bottom.parameters(), optimizer or OptimizerConfig(), lr=lr,
                               momentum=momentum, weight_decay=weight_decay, torch_only=True)
        self.optimizer = ExternalGradDPOptimizer(
            inner,  # type: ignore[arg-type]
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction="mean",
            generator=generator,
        )

    def close(self) -> None:
        """Remove Opacus's hooks and per-sample buffers from the bottom."""
        self.module.remove_hooks()
        for p in self.module._module.parameters():
            for attr in ("grad_sample", "summed_grad"):
                if hasattr(p, attr):
                    delattr(p, attr)

