"""Privacy options by name: what each changes in a client's round, and what it costs.

``privacy.name`` in the config picks one entry of :data:`PRIVACY_OPTIONS`:

``none``
    Raw activations, plain SGD. Nothing is accounted.
``activation_gaussian``
    Each released activation row is clipped to C and noised with std sigma * C
    (:class:`~splitlearn.privacy.mechanism.GaussianActivationMechanism`).
    Every local example is released once per local epoch (shuffled batches
    cover the data once per epoch), so accounting charges one Gaussian step per
    epoch at ``sample_rate=1`` with noise multiplier ``sigma / 2`` (the
    sensitivity of a row to replacing its input is 2C). Sampling gives no
    amplification here: each row is released on its own, not hidden in a sum.
``dpsgd_client``
    DP-SGD on every module the device trains (:mod:`splitlearn.privacy.dpsgd`):
    Opacus's Poisson data loader with ``q = 1 / batches_per_epoch``, per-sample
    gradient clipping to C, noise sigma * C on the sum; one accounted step per
    batch at ``(sigma, q)``, add/remove-one adjacency as in Opacus. Activations
    are sent unnoised.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from splitlearn.config import OptimizerConfig, PrivacyConfig
from splitlearn.light_sgd import LightSGD
from splitlearn.optim import make_optimizer
from splitlearn.privacy.accounting import Step
from splitlearn.privacy.mechanism import GaussianActivationMechanism, batch_coupled_modules

if TYPE_CHECKING:
    from splitlearn.privacy.dpsgd import DPSGDBottom


class UnprotectableRelease(ValueError):
    """The client-side layers produce activations the privacy option cannot protect."""


def secret_generator() -> torch.Generator:
    """Return a torch generator seeded from the OS's entropy, unknown to the server.

    Noise (and DP-SGD's sampling) seeded from anything the server knows, such
    as the experiment seed, could be regenerated and subtracted.
    """
    return torch.Generator().manual_seed(secrets.randbits(63))


class ClientPrivacy:
    """What a privacy option changes in one client's round; this base changes nothing.

    Parameters
    ----------
    settings : PrivacyConfig
        The option's settings.
    loader : DataLoader
        The round's shuffled loader over the local data (a TensorDataset).
    generator : torch.Generator, optional
        Noise and sampling randomness; :func:`secret_generator` when omitted.
    """

    name: ClassVar[str] = "none"
    #: Whether the option protects the activations a client sends (and so needs a
    #: protocol that sends some).
    protects_activations: ClassVar[bool] = False

    def __init__(
        self, settings: PrivacyConfig, loader: DataLoader, *,
        generator: torch.Generator | None = None,
    ) -> None:
        self.settings = settings
        self.loader = loader
        self.generator = generator if generator is not None else secret_generator()

    def round_steps(self, *, epochs: int) -> list[Step]:
        """Accountant steps that ``epochs`` passes over the local data cost."""
        return []

    def batches(self) -> Iterable[tuple[Tensor, Tensor]]:
        """One epoch's batches."""
        return self.loader

    def release(self, activations: Tensor) -> Tensor:
        """Return what is sent for ``activations`` (differentiable: backward runs through it)."""
        return activations

    def make_optimizer(
        self, trained: nn.Module, *, lr: float, momentum: float, weight_decay: float,
        optimizer: OptimizerConfig | None = None,
    ) -> LightSGD | torch.optim.Optimizer:
        """Return the optimiser of the device's trained modules (``optimizer``; None: SGD).

        Plain SGD is torch's update without ``torch.optim.SGD``, whose first construction
        in a process costs seconds (see :mod:`splitlearn.light_sgd`).
        """
        return make_optimizer(trained.parameters(), optimizer or OptimizerConfig(), lr=lr,
                              momentum=momentum, weight_decay=weight_decay)

    @classmethod
    def check_source(cls, bottom: nn.Module) -> None:
        """Refuse client-side layers this option cannot protect (ValueError); none here."""

    def close(self) -> None:
        """Undo anything attached to the modules for training."""


class ActivationGaussianPrivacy(ClientPrivacy):
    """Clip each activation row to C and add N(0, (sigma C)^2) before it is sent."""

    name: ClassVar[str] = "activation_gaussian"
    protects_activations: ClassVar[bool] = True

    def __init__(
        self, settings: PrivacyConfig, loader: DataLoader, *,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(settings, loader, generator=generator)
        self.mechanism = GaussianActivationMechanism(
            clip_norm=settings.clip_norm, noise_multiplier=settings.noise_multiplier,
            generator=self.generator,
        )

    def round_steps(self, *, epochs: int) -> list[Step]:
        """One Gaussian release of every example per epoch (sample rate 1)."""
        return [(self.mechanism.accounting_noise_multiplier, 1.0, epochs)]

    def release(self, activations: Tensor) -> Tensor:
        """Clip and noise."""
        return self.mechanism(activations)

    @classmethod
    def check_source(cls, bottom: nn.Module) -> None:
        """Refuse a client side with BatchNorm: its rows depend on the whole batch."""
        coupled = batch_coupled_modules(bottom)
        if coupled:
            raise UnprotectableRelease(
                f"privacy=activation_gaussian cannot protect activations computed through "
                f"BatchNorm ({', '.join(coupled)}): in training each row depends on the "
                "whole batch, so one example moves every row and the per-row accounting "
                "does not hold; use a model whose client side has no BatchNorm (in the zoo: "
                "cnn, lenet5, vit)"
            )


class DPSGDClientPrivacy(ClientPrivacy):
    """DP-SGD on every module the device trains, with Poisson batches (Opacus)."""

    name: ClassVar[str] = "dpsgd_client"

    def __init__(
        self, settings: PrivacyConfig, loader: DataLoader, *,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(settings, loader, generator=generator)
        from opacus.data_loader import DPDataLoader  # Opacus only where DP-SGD runs

        # Opacus's DP data loader: q = 1 / batches per epoch, that many batches per
        # epoch, empty batches as zero-row tensors.
        self.dp_loader = DPDataLoader.from_data_loader(loader, generator=self.generator)
        self.sample_rate = self.dp_loader.sample_rate
        self._dp: DPSGDBottom | None = None

    @property
    def expected_batch_size(self) -> float:
        """``q * num_examples``: the denominator of the noisy mean gradient."""
        return self.sample_rate * len(self.loader.dataset)  # type: ignore[arg-type]

    def round_steps(self, *, epochs: int) -> list[Step]:
        """One subsampled Gaussian step per batch."""
        return [(self.settings.noise_multiplier, self.sample_rate, epochs * len(self.dp_loader))]

    def batches(self) -> Iterable[tuple[Tensor, Tensor]]:
        """Poisson-sampled batches."""
        return self.dp_loader

    def make_optimizer(
        self, trained: nn.Module, *, lr: float, momentum: float, weight_decay: float,
        optimizer: OptimizerConfig | None = None,
    ) -> torch.optim.Optimizer:
        """Attach per-sample gradient hooks to ``trained``; return Opacus's DP optimiser.

        Opacus clips and noises the per-sample gradients, then ``optimizer`` (None: SGD)
        steps on their noisy mean.
        """
        from splitlearn.privacy.dpsgd import DPSGDBottom

        self._dp = DPSGDBottom(
            trained, lr=lr, momentum=momentum, weight_decay=weight_decay, optimizer=optimizer,
            noise_multiplier=self.settings.noise_multiplier,
            max_grad_norm=self.settings.clip_norm,
            expected_batch_size=self.expected_batch_size, generator=self.generator,
        )
        return self._dp.optimizer

    def close(self) -> None:
        """Remove Opacus's hooks."""
        if self._dp is not None:
            self._dp.close()
            self._dp = None


#: ``privacy.name`` -> behaviour.
PRIVACY_OPTIONS: dict[str, type[ClientPrivacy]] = {
    option.name: option
    for option in (ClientPrivacy, ActivationGaussianPrivacy, DPSGDClientPrivacy)
}


def make_client_privacy(
    settings: PrivacyConfig, loader: DataLoader, *, generator: torch.Generator | None = None
) -> ClientPrivacy:
    """Build the behaviour ``settings.name`` selects for one client round."""
    return PRIVACY_OPTIONS[settings.name](settings, loader, generator=generator)


class ReleaseAtCut(nn.Module):
    """A module that applies a release mechanism (for evaluating the deployed pipeline)."""

    def __init__(self, release: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.release = release

    def forward(self, x: Tensor) -> Tensor:
        """Return ``release(x)``."""
        return self.release(x)


def with_release_at_cut(
    model: nn.Module, *, cut: int, settings: PrivacyConfig,
    generator: torch.Generator | None = None,
) -> nn.Module:
    """Return the model as deployed: activations at ``cut`` pass the release mechanism.

    For ``activation_gaussian`` the trunk only ever sees clipped, noised rows,
    so test accuracy is measured the same way; other options return ``model``.
    """
    if not PRIVACY_OPTIONS[settings.name].protects_activations:
        return model
    mechanism = GaussianActivationMechanism(
        clip_norm=settings.clip_norm, noise_multiplier=settings.noise_multiplier,
        generator=generator,
    )
    stages = list(model.stages)  # type: ignore[attr-defined]
    return nn.Sequential(*stages[:cut], ReleaseAtCut(mechanism), *stages[cut:])
