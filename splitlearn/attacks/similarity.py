"""Image similarity: mean squared error and SSIM (Wang et al., 2004).

SSIM compares local means, variances and the covariance of two images under a
Gaussian window (sigma 1.5, as in the paper). The window is ``window_size``
pixels wide, shrunk to the image size for tiny images (8x8 digits get 7x7), and
slides over the positions where it fits entirely ("valid"), as in the authors'
reference implementation. Constants are ``(0.01 L)^2`` and ``(0.03 L)^2`` for a
data range L. Multi-channel images are scored per channel and averaged.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F  # noqa: N812

K1, K2 = 0.01, 0.03


def mse(x: Tensor, y: Tensor) -> Tensor:
    """Mean squared error per image.

    Parameters
    ----------
    x, y : Tensor
        Batches of shape ``(B, ...)``.

    Returns
    -------
    Tensor
        Shape ``(B,)``.
    """
    _check_pair(x, y)
    return (x - y).pow(2).reshape(len(x), -1).mean(dim=1)


def gaussian_window(size: int, sigma: float, *, dtype: torch.dtype = torch.float64) -> Tensor:
    """Normalised 2-D Gaussian window of shape ``(size, size)``."""
    coords = torch.arange(size, dtype=dtype) - (size - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    g = g / g.sum()
    return torch.outer(g, g)


def window_size_for(height: int, width: int, window_size: int) -> int:
    """Return the odd window size used for an image of ``height x width``."""
    size = min(window_size, height, width)
    return size if size % 2 == 1 else size - 1


def ssim(
    x: Tensor,
    y: Tensor,
    *,
    data_range: float = 1.0,
    window_size: int = 11,
    sigma: float = 1.5,
) -> Tensor:
    """Structural similarity per image (1 for identical images).

    Parameters
    ----------
    x, y : Tensor
        Image batches of shape ``(B, C, H, W)``.
    data_range : float
        L, the range of pixel values (1 for images in [0, 1]).
    window_size : int
        Gaussian window width before shrinking to the image (11 in the paper).
    sigma : float
        Gaussian window standard deviation (1.5 in the paper).

    Returns
    -------
    Tensor
        Shape ``(B,)``: the mean of the SSIM map over positions and channels.
    """
    _check_pair(x, y)
    if x.dim() != 4:
        raise ValueError(f"ssim expects (B, C, H, W) images, got shape {tuple(x.shape)}")
    b, c, h, w = x.shape
    size = window_size_for(h, w, window_size)
    window = gaussian_window(size, sigma).to(x.device)[None, None].repeat(c, 1, 1, 1)
    x64, y64 = x.double(), y.double()

    def local_mean(t: Tensor) -> Tensor:
        return F.conv2d(t, window, groups=c)

    mu_x, mu_y = local_mean(x64), local_mean(y64)
    var_x = local_mean(x64 * x64) - mu_x**2
    var_y = local_mean(y64 * y64) - mu_y**2
    cov = local_mean(x64 * y64) - mu_x * mu_y
    c1, c2 = (K1 * data_range) ** 2, (K2 * data_range) ** 2
    ssim_map = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / (
        (mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2)
    )
    return ssim_map.reshape(b, -1).mean(dim=1).to(x.dtype)


def _check_pair(x: Tensor, y: Tensor) -> None:
    if x.shape != y.shape:
        raise ValueError(f"shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}")
