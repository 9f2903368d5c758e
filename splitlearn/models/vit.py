"""A small Vision Transformer (Dosovitskiy et al. 2021), one stage per block.

FLOP counting
-------------
The per-leaf counter of :mod:`splitlearn.models.base` sees the patch
embedding (a conv), the linear layers, LayerNorm and GELU. The two matmuls of
attention are functional operations, so they live in :class:`AttentionCore`,
a parameter-free leaf that reports its own FLOPs: for ``h`` heads, ``N``
tokens and head width ``d``, ``2*h*N*N*d`` for ``q @ k^T``, the same for
``attn @ v`` and ``4*h*N*N`` for scaling and the softmax (exp, sum, divide).
Residual additions, the class token and the position embedding cost 0, as
elsewhere.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from splitlearn.models.base import CountsOwnFlops, SplittableModel, check_dims

# Patch sizes are chosen so that the token grid is close to 8x8 (64 tokens).
_TARGET_GRID = 8
_MAX_PATCH = 16


def choose_patch_size(image_size: int) -> int:
    """Pick the patch size for a square image.

    Parameters
    ----------
    image_size : int
        Height and width of the input.

    Returns
    -------
    int
        Among the divisors of ``image_size`` from 2 to 16 that leave at least
        a 2x2 token grid (so no pixel is dropped), the one whose grid is
        closest to 8x8, ties to the finer grid: 8 -> 2 (4x4), 28 -> 4 (7x7),
        32 -> 4, 64 -> 8, 224 -> 16 (14x14, as ViT-*/16). Without such a
        divisor (e.g. 13) ``clamp(image_size // 8, 2, 16)``, dropping the last
        few rows and columns; below 4 pixels, 1. Patches of one pixel are
        avoided: a token would be an affine function of a single value, and
        on 8x8 digits such a ViT stayed at chance for 3 SplitFed rounds where
        2x2 patches reached 60%.
    """
    if image_size < 4:
        return 1
    divisors = [
        p for p in range(2, _MAX_PATCH + 1) if image_size % p == 0 and image_size // p >= 2
    ]
    if not divisors:
        return min(max(image_size // _TARGET_GRID, 2), _MAX_PATCH)
    return min(divisors, key=lambda p: (abs(image_size // p - _TARGET_GRID), p))


class PatchEmbedding(nn.Module):
    """Patches -> tokens, prepend a class token, add position embeddings.

    Parameters
    ----------
    in_channels : int
        Input channels.
    image_size : int
        Height and width of the input.
    patch_size : int
        Side of a square patch.
    dim : int
        Token width.
    """

    def __init__(self, in_channels: int, image_size: int, patch_size: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        tokens = (image_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.zeros(1, tokens + 1, dim))
        nn.init.trunc_normal_(self.pos_embedding, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        """Embed an image batch.

        Parameters
        ----------
        x : Tensor
            ``(B, C, H, W)``.

        Returns
        -------
        Tensor
            ``(B, tokens + 1, dim)``, class token first.
        """
        tokens = self.proj(x).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        return torch.cat([cls, tokens], 1) + self.pos_embedding


class AttentionCore(CountsOwnFlops):
    """``softmax(q k^T / sqrt(d)) v`` for ``(B, heads, N, d)`` inputs; counts its FLOPs."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attend.

        Parameters
        ----------
        q, k, v : Tensor
            ``(B, heads, N, d)`` each.

        Returns
        -------
        Tensor
            ``(B, heads, N, d)``.
        """
        # Explicit maths rather than F.scaled_dot_product_attention: the same
        # numbers on every backend, and torch.fx traces it op by op.
        scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        return scores.softmax(-1) @ v

    def count_flops(self, inputs: tuple[Tensor, ...], output: Tensor) -> int:
        """FLOPs of one call: two matmuls plus 4 per score (see module docstring).

        Parameters
        ----------
        inputs : tuple[Tensor, ...]
            ``(q, k, v)``.
        output : Tensor
            The attended values.

        Returns
        -------
        int
            ``4*B*h*N*M*d + 4*B*h*N*M`` for ``N`` queries and ``M`` keys.
        """
        q, k = inputs[0], inputs[1]
        scores = q.shape[:-1].numel() * k.shape[-2]
        return 4 * scores * q.shape[-1] + 4 * scores


class SelfAttention(nn.Module):
    """Multi-head self-attention: ``qkv`` projection, :class:`AttentionCore`, ``proj``.

    Parameters
    ----------
    dim : int
        Token width; must be divisible by ``heads``.
    heads : int
        Number of heads.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.core = AttentionCore()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        """Attend over the tokens of ``x`` (``(B, N, dim)`` in and out)."""
        b, n, dim = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = self.core(q, k, v).transpose(1, 2).reshape(b, n, dim)
        return self.proj(out)


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``.

    Parameters
    ----------
    dim : int
        Token width.
    heads : int
        Attention heads.
    mlp_ratio : float
        Hidden width of the MLP relative to ``dim``.
    """

    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block (``(B, N, dim)`` in and out)."""
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ClassifierHead(nn.Module):
    """Final LayerNorm, take the class token, linear classifier.

    Parameters
    ----------
    dim : int
        Token width.
    num_classes : int
        Number of logits.
    """

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Map ``(B, N, dim)`` tokens to ``(B, num_classes)`` logits."""
        return self.fc(self.norm(x)[:, 0])


class ViT(SplittableModel):
    """Small ViT with ``depth + 2`` stages.

    Stages (cut ``k`` gives stages ``[0, k)`` to the client):

    * 0 ``embed``: :class:`PatchEmbedding` (patch conv, class token, positions)
    * 1 to ``depth`` ``block1`` ..: one :class:`EncoderBlock` each
    * ``depth + 1`` ``head``: :class:`ClassifierHead`

    Every cut between stages sends ``(tokens + 1) * dim`` values per sample,
    the same at every depth; the client's share of compute is what changes.

    Parameters
    ----------
    in_channels : int
        Input channels.
    image_size : int
        Height and width of the square input (8 to 224 and beyond).
    num_classes : int
        Number of output logits.
    patch_size : int | None, optional
        Default ``None``: :func:`choose_patch_size` (a token grid near 8x8 with
        patches of at least 2x2 pixels; 16x16 patches at 224, as ViT-*/16).
    dim : int, optional
        Token width. Default 192, ViT-Tiny's: the smallest published width.
    depth : int, optional
        Encoder blocks. Default 6, half of ViT-Tiny: about 2.7M parameters,
        light enough for CPU clients while leaving 7 cuts.
    heads : int, optional
        Attention heads. Default 3 (64-wide heads, as in every ViT).
    mlp_ratio : float, optional
        MLP hidden width over ``dim``. Default 4, the paper's.
    """

    def __init__(
        self,
        *,
        in_channels: int,
        image_size: int,
        num_classes: int,
        patch_size: int | None = None,
        dim: int = 192,
        depth: int = 6,
        heads: int = 3,
        mlp_ratio: float = 4.0,
    ) -> None:
        check_dims(in_channels, image_size, num_classes)
        if patch_size is None:
            patch_size = choose_patch_size(image_size)
        if not 1 <= patch_size <= image_size:
            raise ValueError(f"patch_size must be in [1, {image_size}], got {patch_size}")
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        stages: list[nn.Module] = [PatchEmbedding(in_channels, image_size, patch_size, dim)]
        stages += [EncoderBlock(dim, heads, mlp_ratio) for _ in range(depth)]
        stages.append(ClassifierHead(dim, num_classes))
        super().__init__(
            stages,
            input_shape=(in_channels, image_size, image_size),
            num_classes=num_classes,
        )
        self.patch_size = patch_size
        self.stage_names = ("embed", *(f"block{i + 1}" for i in range(depth)), "head")
        self._init_weights()

    def _init_weights(self) -> None:
        """Timm's ViT init: truncated normal (std 0.02) linear weights, zero biases."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Conv2d):
                # Patch projection as a linear layer on flattened patches (LeCun normal).
                fan_in = math.prod(module.weight.shape[1:])
                nn.init.trunc_normal_(module.weight, std=fan_in**-0.5)
                nn.init.zeros_(module.bias)
