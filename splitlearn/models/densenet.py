"""DenseNet-121 (Huang et al. 2017): dense blocks joined by transition layers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from splitlearn.models.base import SplittableModel, check_dims

# From this size on the stem is ImageNet's conv7x7/2 + maxpool3x3/2 (4x).
_IMAGENET_STEM_MIN_SIZE = 64


class DenseLayer(nn.Module):
    """``bn-relu-conv1x1(bn_size*k)-bn-relu-conv3x3(k)``, concatenated to its input.

    Concatenating here (instead of keeping a list of earlier outputs, as the
    reference code does) computes the same function and lets one tensor flow
    from layer to layer, so the block is an ``nn.Sequential``.

    Parameters
    ----------
    in_channels : int
        Input channels (all earlier feature maps of the block).
    growth_rate : int
        New channels produced, ``k``.
    bn_size : int
        Bottleneck width multiplier: the 1x1 conv gives ``bn_size * k`` maps.
    """

    def __init__(self, in_channels: int, growth_rate: int, bn_size: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(in_channels)
        self.relu1 = nn.ReLU()
        self.conv1 = nn.Conv2d(in_channels, bn_size * growth_rate, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU()
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, 3, padding=1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Append ``growth_rate`` new feature maps to ``x``.

        Parameters
        ----------
        x : Tensor
            Input of shape ``(B, in_channels, H, W)``.

        Returns
        -------
        Tensor
            ``(B, in_channels + growth_rate, H, W)``.
        """
        new = self.conv1(self.relu1(self.norm1(x)))
        new = self.conv2(self.relu2(self.norm2(new)))
        return torch.cat([x, new], 1)


def _transition(in_channels: int, out_channels: int) -> list[nn.Module]:
    """``bn-relu-conv1x1-avgpool2x2``: compresses channels, halves resolution."""
    return [
        nn.BatchNorm2d(in_channels),
        nn.ReLU(),
        nn.Conv2d(in_channels, out_channels, 1, bias=False),
        nn.AvgPool2d(2),
    ]


class DenseNet(SplittableModel):
    """DenseNet-BC, by default DenseNet-121, split at the transition layers.

    Stages (cut ``k`` gives stages ``[0, k)`` to the client), for the default
    four blocks:

    0. ``stem``: ``conv7x7/2-bn-relu-maxpool3x3/2`` from 64x64 up,
       ``conv3x3-bn-relu`` (stride 1) below
    1. ``dense1``: dense block 1 (6 layers) + transition 1
    2. ``dense2``: dense block 2 (12 layers) + transition 2
    3. ``dense3``: dense block 3 (24 layers) + transition 3
    4. ``dense4``: dense block 4 (16 layers) + ``bn-relu``
    5. ``head``: ``adaptive avg pool - flatten - linear(-> num_classes)``

    Every stage boundary is a transition's output, where a single (compressed,
    downsampled) tensor crosses; inside a block the concatenated maps only grow.
    At 224x224 this is torchvision's ``densenet121`` (7,978,856 parameters for
    1000 classes, 2.9 GMACs); at 32x32 the stride-1 stem keeps 32x32 maps in
    block 1 and the three transitions end at 4x4. Inputs need at least
    ``2 ** (len(block_config) - 1)`` pixels (8 for DenseNet-121).

    Parameters
    ----------
    in_channels : int
        Input channels.
    image_size : int
        Height and width of the square input.
    num_classes : int
        Number of output logits.
    growth_rate : int, optional
        ``k``, channels added per dense layer. Default 32 (DenseNet-121).
    block_config : Sequence[int], optional
        Dense layers per block. Default ``(6, 12, 24, 16)`` (DenseNet-121);
        e.g. ``(2, 2, 2, 2)`` with ``growth_rate=12`` is a faithful miniature.
    num_init_features : int, optional
        Stem width. Default 64 (``2 * k``, DenseNet-121's).
    bn_size : int, optional
        Bottleneck multiplier. Default 4 (the "B" in DenseNet-BC).
    compression : float, optional
        Share of channels a transition keeps. Default 0.5 (the "C").
    """

    channels_last = True  # its trunk steps 1.10x faster so (benchmarks trunk)

    def __init__(
        self,
        *,
        in_channels: int,
        image_size: int,
        num_classes: int,
        growth_rate: int = 32,
        block_config: Sequence[int] = (6, 12, 24, 16),
        num_init_features: int = 64,
        bn_size: int = 4,
        compression: float = 0.5,
    ) -> None:
        check_dims(in_channels, image_size, num_classes)
        if not block_config or min(block_config) < 1:
            raise ValueError(f"block_config needs positive layer counts, got {block_config}")
        min_size = 2 ** (len(block_config) - 1)
        if image_size < min_size:
            raise ValueError(
                f"DenseNet with {len(block_config)} blocks needs image_size >= {min_size}, "
                f"got {image_size}"
            )
        if not 0 < compression <= 1:
            raise ValueError(f"compression must be in (0, 1], got {compression}")
        if image_size >= _IMAGENET_STEM_MIN_SIZE:
            stem = [
                nn.Conv2d(in_channels, num_init_features, 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(num_init_features),
                nn.ReLU(),
                nn.MaxPool2d(3, stride=2, padding=1),
            ]
        else:
            stem = [
                nn.Conv2d(in_channels, num_init_features, 3, padding=1, bias=False),
                nn.BatchNorm2d(num_init_features),
                nn.ReLU(),
            ]
        stages: list[nn.Module] = [nn.Sequential(*stem)]
        features = num_init_features
        for index, layers in enumerate(block_config):
            block: list[nn.Module] = []
            for _ in range(layers):
                block.append(DenseLayer(features, growth_rate, bn_size))
                features += growth_rate
            if index < len(block_config) - 1:
                out = int(features * compression)
                block += _transition(features, out)
                features = out
            else:
                block += [nn.BatchNorm2d(features), nn.ReLU()]
            stages.append(nn.Sequential(*block))
        stages.append(
            nn.Sequential(
                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(features, num_classes)
            )
        )
        super().__init__(
            stages,
            input_shape=(in_channels, image_size, image_size),
            num_classes=num_classes,
        )
        self.stage_names = (
            "stem",
            *(f"dense{i + 1}" for i in range(len(block_config))),
            "head",
        )
        self._init_weights()

    def _init_weights(self) -> None:
        """Apply the reference init: He (fan-in) convs, identity BN, zero linear bias."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

