"""Attacks that measure what smashed data and cut-layer gradients reveal.

* :mod:`~splitlearn.attacks.inversion`: model inversion with a decoder trained
  on (released activations, input) pairs from auxiliary data (on one release, or
  the average of linked ones), and white-box inversion by optimisation through
  the device's layers; scored with MSE and SSIM (:mod:`~splitlearn.attacks.similarity`).
* :mod:`~splitlearn.attacks.dcor`: distance correlation between inputs and
  released activations.
* :mod:`~splitlearn.attacks.label_leak`: label leakage from the cut-layer
  gradients the trunk returns (norm and direction attacks, ROC AUC).
"""

from splitlearn.attacks.dcor import bias_corrected_distance_correlation, distance_correlation
from splitlearn.attacks.inversion import (
    InversionDecoder,
    InversionResult,
    invert,
    linked_releases,
    optimise_inversion,
)
from splitlearn.attacks.label_leak import (
    cut_layer_gradients,
    direction_attack_auc,
    norm_attack_auc,
    one_vs_rest_norm_auc,
    roc_auc,
)
from splitlearn.attacks.similarity import mse, ssim

__all__ = [
    "InversionDecoder",
    "InversionResult",
    "cut_layer_gradients",
    "direction_attack_auc",
    "bias_corrected_distance_correlation",
    "distance_correlation",
    "invert",
    "linked_releases",
    "mse",
    "norm_attack_auc",
    "one_vs_rest_norm_auc",
    "optimise_inversion",
    "roc_auc",
    "ssim",
]
