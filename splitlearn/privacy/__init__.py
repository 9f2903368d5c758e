"""Privacy of what leaves a client: activation clip+noise, DP-SGD, accounting.

Mechanisms (:mod:`~splitlearn.privacy.mechanism`, :mod:`~splitlearn.privacy.dpsgd`)
are separate from accounting (:mod:`~splitlearn.privacy.accounting`); the
config's ``privacy.name`` picks one behaviour from
:data:`~splitlearn.privacy.registry.PRIVACY_OPTIONS`. What each option's epsilon
covers, and what it does not, is spelt out in ``docs/how-to/privacy.md``.
"""

from splitlearn.privacy.accounting import (
    PrivacyAccountant,
    PrivacyBudgetExhausted,
    Step,
    compute_epsilon,
)
from splitlearn.privacy.mechanism import (
    GaussianActivationMechanism,
    clip_per_sample,
    per_sample_norms,
)
from splitlearn.privacy.registry import (
    PRIVACY_OPTIONS,
    ClientPrivacy,
    make_client_privacy,
    secret_generator,
    with_release_at_cut,
)

__all__ = [
    "PRIVACY_OPTIONS",
    "ClientPrivacy",
    "DPSGDBottom",
    "ExternalGradDPOptimizer",
    "GaussianActivationMechanism",
    "PrivacyAccountant",
    "PrivacyBudgetExhausted",
    "Step",
    "clip_per_sample",
    "compute_epsilon",
    "make_client_privacy",
    "per_sample_norms",
    "secret_generator",
    "with_release_at_cut",
]


def __getattr__(name: str) -> object:
    # DP-SGD's classes subclass Opacus's, whose import takes seconds: load them on use.
    if name in ("DPSGDBottom", "ExternalGradDPOptimizer"):
        from splitlearn.privacy import dpsgd

        return getattr(dpsgd, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
