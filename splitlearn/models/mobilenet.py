"""MobileNetV2 (Sandler et al. 2018): inverted residuals with linear bottlenecks."""

from __future__ import annotations

import math

from torch import Tensor, nn

from splitlearn.models.base import SplittableModel, check_dims

# (expansion t, output channels c, blocks n, stride s) per bottleneck group,
# Table 2 of the paper.
_SETTINGS = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
_STEM_WIDTH = 32
_LAST_WIDTH = 1280
# Stride-2 points: the stem and the groups with s == 2 (five in all, 32x).
_DOWNSAMPLINGS = 1 + sum(1 for *_, s in _SETTINGS if s == 2)
# Smallest final feature map the downsampling plan aims for (7x7 at 224).
_MIN_FINAL_SIZE = 4


def _make_divisible(value: float, divisor: int = 8) -> int:
    """Round a width to a multiple of ``divisor``, never below 90% of ``value``.

    The rule of the reference implementation, so that width multipliers
    give the published channel counts.
    """
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


def _conv_bn_relu6(
    in_channels: int, out_channels: int, kernel: int, stride: int = 1, groups: int = 1
) -> list[nn.Module]:
    return [
        nn.Conv2d(
            in_channels,
            out_channels,
            kernel,
            stride=stride,
            padding=(kernel - 1) // 2,
            groups=groups,
            bias=False,
        ),
        nn.BatchNorm2d(out_channels),
        nn.ReLU6(),
    ]


class InvertedResidual(nn.Module):
    """``[1x1 expand-bn-relu6] - 3x3 depthwise-bn-relu6 - 1x1 project-bn`` (+ input).

    Parameters
    ----------
    in_channels : int
        Input channels.
    out_channels : int
        Output channels.
    stride : int
        Stride of the depthwise conv (1 or 2).
    expansion : int
        Hidden width is ``in_channels * expansion``; 1 skips the expand conv.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = in_channels * expansion
        # The residual only exists where shapes match (the paper's rule).
        self.use_residual = stride == 1 and in_channels == out_channels
        layers: list[nn.Module] = []
        if expansion != 1:
            layers += _conv_bn_relu6(in_channels, hidden, 1)
        layers += _conv_bn_relu6(hidden, hidden, 3, stride=stride, groups=hidden)
        layers += [nn.Conv2d(hidden, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block.

        Parameters
        ----------
        x : Tensor
            Input of shape ``(B, in_channels, H, W)``.

        Returns
        -------
        Tensor
            Output of shape ``(B, out_channels, H / stride, W / stride)``.
        """
        if self.use_residual:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(SplittableModel):
    """MobileNetV2 in ten stages.

    Stages (cut ``k`` gives stages ``[0, k)`` to the client):

    * 0 ``stem``: ``conv3x3(C_in -> 32)-bn-relu6``
    * 1 to 7 ``bottleneck1`` .. ``bottleneck7``: the seven groups of inverted
      residual blocks of the paper's Table 2 (16, 24, 32, 64, 96, 160 and 320
      channels); residual additions stay inside a group.
    * 8 ``conv_last``: ``conv1x1(320 -> 1280)-bn-relu6``
    * 9 ``head``: ``adaptive avg pool - flatten - dropout - linear(1280 -> num_classes)``

    At 224x224 and ``width_mult=1`` this is torchvision's ``mobilenet_v2``
    (3,504,872 parameters for 1000 classes, about 300 MMACs). The network has
    five stride-2 points (the stem and four groups); an input keeps the last
    ``min(5, round(log2(image_size / 4)))`` of them, so the final map is
    about 4x4 (7x7 at 224; a 32x32 or 28x28 input gets a stride-1 stem and
    first group, the usual CIFAR adaptation).

    Parameters
    ----------
    in_channels : int
        Input channels.
    image_size : int
        Height and width of the square input, at least 4.
    num_classes : int
        Number of output logits.
    width_mult : float, optional
        Multiplier on every width (rounded to multiples of 8). Default 1.0,
        the reference network; 0.5 or 0.35 are the paper's small variants for
        weaker devices.
    dropout : float, optional
        Dropout before the classifier. Default 0.2, torchvision's.
    """

    channels_last = True  # its trunk steps 1.18x faster so (benchmarks trunk)

    def __init__(
        self,
        *,
        in_channels: int,
        image_size: int,
        num_classes: int,
        width_mult: float = 1.0,
        dropout: float = 0.2,
    ) -> None:
        check_dims(in_channels, image_size, num_classes)
        if image_size < _MIN_FINAL_SIZE:
            raise ValueError(f"MobileNetV2 needs image_size >= 4, got {image_size}")
        if width_mult <= 0:
            raise ValueError(f"width_mult must be > 0, got {width_mult}")
        halvings = min(_DOWNSAMPLINGS, round(math.log2(image_size / _MIN_FINAL_SIZE)))
        strided = _DOWNSAMPLINGS - halvings  # the earliest stride-2 points become 1
        point = 0  # index of the next stride-2 point

        def stride_for(s: int) -> int:
            nonlocal point
            if s != 2:
                return s
            point += 1
            return 1 if point <= strided else 2

        width = _make_divisible(_STEM_WIDTH * width_mult)
        stages: list[nn.Module] = [
            nn.Sequential(*_conv_bn_relu6(in_channels, width, 3, stride=stride_for(2)))
        ]
        for expansion, channels, blocks, s in _SETTINGS:
            out = _make_divisible(channels * width_mult)
            group = []
            for index in range(blocks):
                stride = stride_for(s) if index == 0 else 1
                group.append(InvertedResidual(width, out, stride, expansion))
                width = out
            stages.append(nn.Sequential(*group))
        last = _make_divisible(_LAST_WIDTH * max(1.0, width_mult))
        stages.append(nn.Sequential(*_conv_bn_relu6(width, last, 1)))
        stages.append(
            nn.Sequential(
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Dropout(dropout),
                nn.Linear(last, num_classes),
            )
        )
        super().__init__(
            stages,
            input_shape=(in_channels, image_size, image_size),
            num_classes=num_classes,
        )
        self.stage_names = (
            "stem",
            *(f"bottleneck{i + 1}" for i in range(len(_SETTINGS))),
            "conv_last",
            "head",
        )
        self._init_weights()

    def _init_weights(self) -> None:
        """Apply the reference init: He (fan-out) convs, N(0, 0.01) classifier."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0, 0.01)
                nn.init.zeros_(module.bias)
