"""Distance correlation (Székely, Rizzo and Bakirov, 2007) between two samples.

0 if and only if the two variables are independent (in the population), 1 for
a similarity transform of each other. Used in split learning (NoPeek, Vepakomma
et al. 2020) to measure how much of the input the smashed data still carries.
O(n^2) memory: meant for a few thousand samples at most.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _double_centered_distances(z: Tensor) -> Tensor:
    d = torch.cdist(z, z)
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
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"need two samples of equal size >= 2, got {len(x)} and {len(y)}")
    a = _double_centered_distances(x.reshape(len(x), -1).double())
    b = _double_centered_distances(y.reshape(len(y), -1).double())
    dcov2_xy = (a * b).mean()
    dvar2_x, dvar2_y = (a * a).mean(), (b * b).mean()
    if dvar2_x <= 0 or dvar2_y <= 0:
        return 0.0
    dcor2 = dcov2_xy / torch.sqrt(dvar2_x * dvar2_y)
    return float(dcor2.clamp(min=0.0).sqrt())
