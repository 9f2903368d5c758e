"""ResNets built from BasicBlocks, split into stem/groups/head.

:class:`ResNet` is the small CIFAR-style network (registry name ``"resnet"``);
:class:`ResNet18` is He et al.'s ResNet-18 (registry name ``"resnet18"``),
parameter for parameter the torchvision architecture (11,689,512 parameters
for 3x224x224 inputs and 1000 classes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor, nn

from splitlearn.models.base import SplittableModel, check_dims

# Above this size the stem downsamples once so larger inputs stay cheap.
_STRIDE1_MAX_SIZE = 32
# From this size on the "auto" stem is ImageNet's 7x7/2 conv + 3x3/2 max pool
# (4x downsampling); below it a 3x3 stride-1 conv keeps small images' detail,
# as CIFAR ResNets do.
_IMAGENET_STEM_MIN_SIZE = 64
_STEMS = ("cifar", "imagenet", "auto")


class BasicBlock(nn.Module):
    """``conv-bn-relu-conv-bn`` plus a shortcut, followed by ReLU.

    Parameters
    ----------
    in_channels : int
        Input channels.
    out_channels : int
        Output channels.
    stride : int, optional
        Stride of the first conv (2 to downsample).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(
            in_channels, out_channels, 3, stride=stride, padding=1, bias=False
        )
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            # Projection shortcut: a 1x1 conv matches channels and resolution.
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        """Apply the residual block.

        Parameters
        ----------
        x : Tensor
            Input of shape ``(B, in_channels, H, W)``.

        Returns
        -------
        Tensor
            Output of shape ``(B, out_channels, H', W')``.
        """
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class ResNet(SplittableModel):
    """ResNet with stages ``[stem, group_0, ..., group_{n-1}, head]``.

    The stem is ``conv3x3-bn-relu`` with stride 1 for inputs up to 32x32 and
    stride 2 above. Group ``i`` holds ``blocks_per_stage`` BasicBlocks of
    width ``widths[i]``; every group after the first halves the resolution in
    its first block. The head is global average pooling, flatten and linear.

    Parameters
    ----------
    in_channels : int
        Input channels (1 or 3).
    image_size : int
        Height and width of the square input (8 to 32 intended).
    num_classes : int
        Number of output logits.
    widths : Sequence[int], optional
        Channel width of each block group. Default ``(16, 32, 64)``: the
        CIFAR ResNet-20 family widths, which fit three halvings into 8x8
        inputs and keep client compute small.
    blocks_per_stage : int, optional
        BasicBlocks per group. Default 1: the shallowest residual net (an
        8-layer ResNet), cheap enough for many simulated CPU clients.
    stem : str, optional
        ``"cifar"`` (default, the behaviour described above), ``"imagenet"``
        (``conv7x7/2-bn-relu-maxpool3x3/2``, as in He et al.) or ``"auto"``
        (``"imagenet"`` for inputs of at least 64x64, else ``conv3x3``
        with stride 1).
    norm : str, optional
        ``"batch"`` (default) or ``"group"``: GroupNorm with :data:`NORM_GROUPS` groups
        in place of every batch norm. Batch norm's running statistics, averaged over
        many devices that each train a few batches a round, stay near their initial
        values for rounds (16 devices of 90 digits: 95% training accuracy, 13% at test
        after 3 rounds, 0.16 running variance against 0.03 measured at the stem);
        GroupNorm keeps none, so a model evaluates as it trains (Hsieh et al., 2020).
    """

    # Its trunk steps 1.19x faster so at cut 1, ResNet-18's 1.04x at cut 2
    # (python -m benchmarks trunk).
    channels_last = True

    def __init__(
        self,
        *,
        in_channels: int,
        image_size: int,
        num_classes: int,
        widths: Sequence[int] = (16, 32, 64),
        blocks_per_stage: int = 1,
        stem: str = "cifar",
        norm: str = "batch",
    ) -> None:
        check_dims(in_channels, image_size, num_classes)
        if norm not in ("batch", "group"):
            raise ValueError(f"unknown norm {norm!r}; accepted: 'batch', 'group'")
        if stem not in _STEMS:
            raise ValueError(f"unknown stem {stem!r}; accepted stems are {list(_STEMS)}")
        if not widths:
            raise ValueError("widths must name at least one block group")
        if blocks_per_stage < 1:
            raise ValueError(f"blocks_per_stage must be >= 1, got {blocks_per_stage}")
        stages: list[nn.Module] = [_stem(stem, in_channels, widths[0], image_size)]
        prev = widths[0]
        for index, width in enumerate(widths):
            stages.append(_group(prev, width, blocks_per_stage, 1 if index == 0 else 2))
            prev = width
        stages.append(
            nn.Sequential(
                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(prev, num_classes)
            )
        )
        super().__init__(
            stages,
            input_shape=(in_channels, image_size, image_size),
            num_classes=num_classes,
        )
        if norm == "group":
            _group_norms(self)
        self._init_weights()

    def _init_weights(self) -> None:
        """He init for convs (suits ReLU), identity-like BatchNorm."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(
                    module.weight, mode="fan_out", nonlinearity="relu"
                )
            elif isinstance(module, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)


class ResNet18(ResNet):
    """ResNet-18 (He et al. 2016): stages ``stem | layer1..layer4 | head``.

    Widths ``(64, 128, 256, 512)`` with two BasicBlocks each; ``layer2`` to
    ``layer4`` halve the resolution in their first block (1x1 projection
    shortcut). The head is global average pooling and a linear layer.

    Parameters
    ----------
    in_channels : int
        Input channels.
    image_size : int
        Height and width of the square input, 8 to 224 (and beyond).
    num_classes : int
        Number of output logits.
    stem : str, optional
        Default ``"auto"``: ImageNet's ``conv7x7/2 + maxpool/2`` from 64x64 up
        (so 224x224 gives the published network, 1.82 GMACs), a 3x3 stride-1
        conv below (the CIFAR adaptation; 4x downsampling would leave 2x2
        maps at 32x32 before ``layer2``).
    norm : str, optional
        As for :class:`ResNet`.
    """

    def __init__(
        self,
        *,
        in_channels: int,
        image_size: int,
        num_classes: int,
        stem: str = "auto",
        norm: str = "batch",
    ) -> None:
        super().__init__(
            in_channels=in_channels,
            image_size=image_size,
            num_classes=num_classes,
            norm=norm,
            widths=(64, 128, 256, 512),
            blocks_per_stage=2,
            stem=stem,
        )
        self.stage_names = ("stem", "layer1", "layer2", "layer3", "layer4", "head")


def _stem(kind: str, in_channels: int, width: int, image_size: int) -> nn.Sequential:
    """Build the stem: see the ``stem`` parameter of :class:`ResNet`."""
    if kind == "auto":
        kind = "imagenet" if image_size >= _IMAGENET_STEM_MIN_SIZE else "small"
    if kind == "imagenet":
        return nn.Sequential(
            nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
    # "cifar" keeps the original rule; "small" (auto below 64 px) never strides.
    stride = 2 if kind == "cifar" and image_size > _STRIDE1_MAX_SIZE else 1
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
    )


def _group(in_channels: int, width: int, blocks: int, stride: int) -> nn.Sequential:
    """Build one group of ``blocks`` BasicBlocks; only the first one strides."""
    layers = [BasicBlock(in_channels, width, stride)]
    layers += [BasicBlock(width, width) for _ in range(blocks - 1)]
    return nn.Sequential(*layers)


#: GroupNorm's groups with ``norm="group"`` (fewer where a layer has fewer channels).
NORM_GROUPS = 8


def _group_norms(module: nn.Module) -> None:
    """Replace every ``BatchNorm2d`` below ``module`` by a GroupNorm of as many channels."""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            channels = child.num_features
            setattr(module, name, nn.GroupNorm(math.gcd(NORM_GROUPS, channels), channels))
        else:
            _group_norms(child)
