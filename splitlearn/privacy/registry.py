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
    DP-SGD on the client-side layers (:mod:`splitlearn.privacy.dpsgd`):
    Poisson batches with ``q = 1 / batches_per_epoch``, per-sample gradient
    clipping to C, noise sigma * C on the sum; one accounted step per batch at
    ``(sigma, q)``, add/remove-one adjacency as in Opacus. Activations are sent
    unnoised.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from splitlearn.privacy.accounting import Step
from splitlearn.privacy.dpsgd import DPSGDBottom, poisson_batches
from splitlearn.privacy.mechanism import GaussianActivationMechanism


@dataclass(frozen=True, kw_only=True)
class PrivacySettings:
    """One client's privacy settings (the ``privacy`` config group, flattened).

    Parameters
    ----------
    name : str
        A key of :data:`PRIVACY_OPTIONS`.
    clip_norm : float
        C: L2 bound per sample (activations or gradients, by option).
    noise_multiplier : float
        sigma: noise std is ``sigma * C``; must be > 0 unless ``name == "none"``.
    delta : float
        The delta epsilon is reported at.
    epsilon_max : float | None
        Per-client budget; None for none.
    """

    name: str = "none"
    clip_norm: float = 1.0
    noise_multiplier: float = 0.0
    delta: float = 1e-5
    epsilon_max: float | None = None

    def __post_init__(self) -> None:
        if self.name not in PRIVACY_OPTIONS:
            raise ValueError(
                f"privacy.name={self.name!r} is not available; accepted: {sorted(PRIVACY_OPTIONS)}"
            )
        if self.name != "none":
            if not self.clip_norm > 0:
                raise ValueError(f"privacy.clip_norm must be > 0, got {self.clip_norm!r}")
            if not self.noise_multiplier > 0:
                raise ValueError(
                    f"privacy.noise_multiplier must be > 0 for privacy={self.name}, got "
                    f"{self.noise_multiplier!r} (use privacy=none for no noise)"
                )
            if not 0 < self.delta < 1:
                raise ValueError(f"privacy.delta must be in (0, 1), got {self.delta!r}")

    @property
    def accounted(self) -> bool:
        """Whether this option spends privacy budget (everything but ``none``)."""
        return self.name != "none"

    @classmethod
    def from_task(cls, task: Any) -> PrivacySettings:
        """Read the ``privacy*`` fields of a :class:`~splitlearn.task.SplitTask`."""
        return cls(
            name=task.privacy,
            clip_norm=task.privacy_clip_norm,
            noise_multiplier=task.privacy_noise_multiplier,
            delta=task.privacy_delta,
            epsilon_max=task.privacy_epsilon_max if task.privacy_epsilon_max > 0 else None,
        )

    @classmethod
    def from_config(cls, privacy: Any) -> PrivacySettings:
        """Read the ``privacy`` config node (a DictConfig or PrivacyConfig)."""
        return cls(
            name=privacy.name,
            clip_norm=float(privacy.clip_norm),
            noise_multiplier=float(privacy.noise_multiplier),
            delta=float(privacy.delta),
            epsilon_max=None if privacy.epsilon_max is None else float(privacy.epsilon_max),
        )


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
    settings : PrivacySettings
        The option's settings.
    loader : DataLoader
        The round's shuffled loader over the local data (a TensorDataset).
    generator : torch.Generator, optional
        Noise and sampling randomness; :func:`secret_generator` when omitted.
    """

    name: ClassVar[str] = "none"

    def __init__(
        self,
        settings: PrivacySettings,
        loader: DataLoader,
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        self.settings = settings
        self.loader = loader
        self.generator = generator if generator is not None else secret_generator()

    def round_steps(self, *, epochs: int) -> list[Step]:
        """Accountant steps that ``epochs`` passes over the local data cost."""
        return []

    def batches(self) -> Callable[[], Iterable[tuple[Tensor, Tensor]]]:
        """Return a callable that yields one epoch's batches per call."""
        return lambda: self.loader

    @property
    def release(self) -> Callable[[Tensor], Tensor] | None:
        """Applied to the activations before they are sent (None: sent as they are)."""
        return None

    def make_optimizer(
        self, bottom: nn.Module, *, lr: float, momentum: float, weight_decay: float
    ) -> torch.optim.Optimizer | None:
        """Return the client optimiser; None lets the training loop build plain SGD."""
        return None

    def close(self) -> None:
        """Undo anything attached to the bottom for training."""


class ActivationGaussianPrivacy(ClientPrivacy):
    """Clip each activation row to C and add N(0, (sigma C)^2) before it is sent."""

    name: ClassVar[str] = "activation_gaussian"

    def __init__(
        self,
        settings: PrivacySettings,
        loader: DataLoader,
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(settings, loader, generator=generator)
        self.mechanism = GaussianActivationMechanism(
            clip_norm=settings.clip_norm,
            noise_multiplier=settings.noise_multiplier,
            generator=self.generator,
        )

    def round_steps(self, *, epochs: int) -> list[Step]:
        """One Gaussian release of every example per epoch (sample rate 1)."""
        return [(self.mechanism.accounting_noise_multiplier, 1.0, epochs)]

    @property
    def release(self) -> Callable[[Tensor], Tensor]:
        """The clip-and-noise mechanism."""
        return self.mechanism


class DPSGDClientPrivacy(ClientPrivacy):
    """DP-SGD on the client-side layers with Poisson batches (Opacus)."""

    name: ClassVar[str] = "dpsgd_client"

    def __init__(
        self,
        settings: PrivacySettings,
        loader: DataLoader,
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(settings, loader, generator=generator)
        # Opacus's convention (DPDataLoader): q = 1 / batches per epoch.
        self.num_batches = max(len(loader), 1)
        self.sample_rate = 1.0 / self.num_batches
        self._dp: DPSGDBottom | None = None

    @property
    def expected_batch_size(self) -> float:
        """``q * num_examples``: the denominator of the noisy mean gradient."""
        return self.sample_rate * len(self.loader.dataset)

    def round_steps(self, *, epochs: int) -> list[Step]:
        """One subsampled Gaussian step per batch."""
        return [(self.settings.noise_multiplier, self.sample_rate, epochs * self.num_batches)]

    def batches(self) -> Callable[[], Iterable[tuple[Tensor, Tensor]]]:
        """Poisson-sampled batches, ``batches per epoch`` of them per call."""
        return lambda: poisson_batches(
            self.loader.dataset, sample_rate=self.sample_rate, num_batches=self.num_batches,
            generator=self.generator,
        )

    def make_optimizer(
        self, bottom: nn.Module, *, lr: float, momentum: float, weight_decay: float
    ) -> torch.optim.Optimizer:
        """Attach per-sample gradient hooks to ``bottom``; return Opacus's DP optimiser."""
        self._dp = DPSGDBottom(
            bottom, lr=lr, momentum=momentum, weight_decay=weight_decay,
            noise_multiplier=self.settings.noise_multiplier,
            max_grad_norm=self.settings.clip_norm,
            expected_batch_size=self.expected_batch_size,
            generator=self.generator,
        )
        return self._dp.optimizer

    def close(self) -> None:
        """Remove Opacus's hooks."""
        if self._dp is not None:
            self._dp.close()
            self._dp = None


#: ``privacy.name`` -> behaviour.
PRIVACY_OPTIONS: dict[str, type[ClientPrivacy]] = {
    "none": ClientPrivacy,
    "activation_gaussian": ActivationGaussianPrivacy,
    "dpsgd_client": DPSGDClientPrivacy,
}


def make_client_privacy(
    settings: PrivacySettings,
    loader: DataLoader,
    *,
    generator: torch.Generator | None = None,
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
    model: nn.Module,
    *,
    cut: int,
    settings: PrivacySettings,
    generator: torch.Generator | None = None,
) -> nn.Module:
    """Return the model as deployed: activations at ``cut`` pass the release mechanism.

    For ``activation_gaussian`` the trunk only ever sees clipped, noised rows,
    so test accuracy is measured the same way; other options return ``model``.

    Parameters
    ----------
    model : nn.Module
        A splittable model (``model.stages``); not modified.
    cut : int
        Stages ``[0, cut)`` are the client's.
    settings : PrivacySettings
        The run's privacy settings.
    generator : torch.Generator, optional
        Noise source.
    """
    if settings.name != "activation_gaussian":
        return model
    mechanism = GaussianActivationMechanism(
        clip_norm=settings.clip_norm, noise_multiplier=settings.noise_multiplier,
        generator=generator,
    )
    stages = list(model.stages)  # type: ignore[attr-defined]
    return nn.Sequential(*stages[:cut], ReleaseAtCut(mechanism), *stages[cut:])
