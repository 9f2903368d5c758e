"""Label differential privacy by randomised response, applied once per example on the device.

In U-shaped training the labels never leave the device, yet the gradients it sends
back reveal them (the norm and direction attacks of :mod:`splitlearn.attacks.label_leak`
reach AUC near 1); in the other protocols the labels travel to the trunk as they
are. K-ary randomised response (Warner 1965; as label DP in Ghazi et al. 2021,
"Deep Learning with Label Differential Privacy") replaces each label before
training: it is kept with probability ``e^eps / (e^eps + K - 1)`` and otherwise
replaced by one of the other ``K - 1`` classes, uniformly. Any two labels then
produce any output with probabilities within a factor ``e^eps``, so everything the
device releases afterwards (activations, gradients, weights, labels sent to the
trunk, metrics) is eps-label-DP against the server, whatever it does: it is
computed from the randomised labels and the inputs only (post-processing).

That holds only if each example is randomised once. Drawing fresh labels every
round would release the same label again and again (eps adds up per draw), so
the draw is seeded by a secret the node keeps (:func:`randomized_labels`); a node
that keeps a privacy ledger keeps the secret beside it, so a restart or a new run
on the same data draws the same labels.

This module is the pure mathematics: no Flower, no state.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def keep_probability(epsilon: float, num_classes: int) -> float:
    """Probability that randomised response keeps a label: ``e^eps / (e^eps + K - 1)``.

    Raises
    ------
    ValueError
        For a non-positive or non-finite epsilon, or fewer than 2 classes.
    """
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"label epsilon must be a finite number > 0, got {epsilon!r}")
    if num_classes < 2:
        raise ValueError(f"randomised response needs at least 2 classes, got {num_classes}")
    # exp(-eps) form: no overflow for large epsilon.
    return 1.0 / (1.0 + (num_classes - 1) * math.exp(-epsilon))


def transition_matrix(epsilon: float, num_classes: int) -> Tensor:
    """``T[i, j]``: probability that true label ``i`` is released as ``j`` (float64)."""
    keep = keep_probability(epsilon, num_classes)
    # Not (1 - keep) / (K - 1): for a large epsilon that difference loses every digit.
    other = math.exp(-epsilon) * keep
    matrix = torch.full((num_classes, num_classes), other, dtype=torch.float64)
    matrix.fill_diagonal_(keep)
    return matrix


def randomized_response(labels: Tensor, *, epsilon: float, num_classes: int,
                        generator: torch.Generator) -> Tensor:
    """Return ``labels`` after K-ary randomised response (int64, same shape).

    Each label is kept with :func:`keep_probability`, else replaced by one of the
    other classes drawn uniformly. Labels outside ``0 .. K-1`` are refused (ValueError).
    """
    if labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < num_classes:
        raise ValueError(f"labels span {int(labels.min())}..{int(labels.max())}; "
                         f"expected 0..{num_classes - 1}")
    keep = keep_probability(epsilon, num_classes)
    labels = labels.to(torch.int64)
    kept = torch.rand(labels.shape, generator=generator, dtype=torch.float64) < keep
    # An offset of 1 .. K-1 added modulo K is a uniform draw among the other classes.
    offset = torch.randint(1, num_classes, labels.shape, generator=generator)
    return torch.where(kept, labels, (labels + offset) % num_classes)


def randomized_labels(labels: Tensor, *, epsilon: float, num_classes: int, secret: int
                      ) -> Tensor:
    """Randomise a dataset's labels once, repeatably: the same ``secret`` draws the same labels.

    ``secret`` is the node's (never sent); with the dataset in the same order, every
    round and every run that uses it trains on the same released labels.
    """
    generator = torch.Generator().manual_seed(secret)
    return randomized_response(labels, epsilon=epsilon, num_classes=num_classes,
                               generator=generator)
