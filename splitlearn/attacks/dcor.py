"""Distance correlation (Székely, Rizzo and Bakirov, 2007) between two samples.

0 if and only if the two variables are independent (in the population), 1 for
a similarity transform of each other. Used in split learning (NoPeek, Vepakomma
et al. 2020) to measure how much of the input the smashed data still carries.
O(n^2) memory: meant for a few thousand samples at most.

The plain sample statistic is biased upwards, badly so in high dimension: 144
digit images against pure noise score about 0.67, so noised activations all sit
near that floor and cannot be told apart.
:func:`bias_corrected_distance_correlation` (Székely and Rizzo, 2014: U-centred
distances) is unbiased for the squared population value and close to 0 for
independent samples of any dimension.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _distances(z: Tensor, smooth: float) -> Tensor:
    if not smooth:
        return torch.cdist(z, z)
    # From differences, not |a|^2 + |b|^2 - 2ab: its rounding makes equal rows a few ulps
    # apart, and a constant sample then looks correlated, with an enormous gradient.
    # cdist's backward is 0 where two rows coincide.
    return torch.cdist(z, z, compute_mode="donot_use_mm_for_euclid_dist")


def _double_centered(d: Tensor) -> Tensor:
    return d - d.mean(dim=0, keepdim=True) - d.mean(dim=1, keepdim=True) + d.mean()


def distance_correlation(x: Tensor, y: Tensor) -> float:
    """Sample distance correlation between paired rows of ``x`` and ``y``.

    Parameters
    ----------
    x, y : Tensor
        Shapes ``(n, ...)`` with the same ``n`` (>= 2); each sample is flattened.

    Returns
    -------
    float
        In [0, 1]; 0 when either sample is constant.
    """
    with torch.no_grad():
        return float(distance_correlation_tensor(x.double(), y.double(), smooth=0.0))


def distance_correlation_tensor(x: Tensor, y: Tensor, *, smooth: float = 1e-12) -> Tensor:
    """:func:`distance_correlation` as a differentiable scalar, in ``x``'s and ``y``'s dtype.

    What NoPeek (Vepakomma et al., 2020) adds to the device's loss. With
    ``smooth`` > 0 the last square root is taken of its argument plus
    ``smooth``, so that the gradient stays finite where the statistic is 0, and
    distances come from row differences; ``smooth=0`` is the exact statistic.
    """
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"need two samples of equal size >= 2, got {len(x)} and {len(y)}")
    a = _double_centered(_distances(x.reshape(len(x), -1), smooth))
    b = _double_centered(_distances(y.reshape(len(y), -1), smooth))
    dcov2_xy = (a * b).mean()
    dvar2 = (a * a).mean() * (b * b).mean()
    if not dvar2 > 0:
        return dcov2_xy * 0.0  # a constant sample: independent, and still in the graph
    return (dcov2_xy / dvar2.sqrt()).clamp(min=0.0).add(smooth).sqrt()


def _u_centered_distances(z: Tensor) -> Tensor:
    """U-centred distance matrix (zero diagonal), Székely and Rizzo (2014), eq. (3.1)."""
    n = len(z)
    d = torch.cdist(z, z)
    rows = d.sum(dim=1, keepdim=True)
    cols = d.sum(dim=0, keepdim=True)
    u = d - rows / (n - 2) - cols / (n - 2) + d.sum() / ((n - 1) * (n - 2))
    u.fill_diagonal_(0.0)
    return u


def bias_corrected_distance_correlation(x: Tensor, y: Tensor) -> float:
    """Unbiased estimate of the squared distance correlation (Székely and Rizzo, 2014).

    ``(A . B) / sqrt((A . A)(B . B))`` over U-centred distance matrices, with
    ``(A . B) = sum_{i != j} A_ij B_ij / (n (n - 3))``. It estimates dCor^2
    without bias, so it can come out slightly negative, and it is near 0 for
    independent samples whatever their dimension.

    Parameters
    ----------
    x, y : Tensor
        Shapes ``(n, ...)`` with the same ``n`` (>= 4); each sample is flattened.

    Returns
    -------
    float
        In [-1, 1]; 0 when either sample is constant.
    """
    if len(x) != len(y) or len(x) < 4:
        raise ValueError(f"need two samples of equal size >= 4, got {len(x)} and {len(y)}")
    a = _u_centered_distances(x.reshape(len(x), -1).double())
    b = _u_centered_distances(y.reshape(len(y), -1).double())
    ab, aa, bb = (a * b).sum(), (a * a).sum(), (b * b).sum()
    if aa <= 0 or bb <= 0:
        return 0.0
    return float((ab / torch.sqrt(aa * bb)).clamp(-1.0, 1.0))
