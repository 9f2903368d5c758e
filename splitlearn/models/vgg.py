"""VGG-11 with batch norm (Simonyan & Zisserman 2015, configuration "A")."""

from __future__ import annotations

import math

from torch import nn

from splitlearn.models.base import SplittableModel, check_dims

# Configuration A: conv widths per block; every block ends with a 2x2 max pool.
_BLOCKS = ((64,), (128,), (256, 256), (512, 512), (512, 512))
# The ImageNet network ends on a 7x7 map (224 / 2**5).
_IMAGENET_POOLED = 7
# From this size on the classifier is ImageNet's 4096-wide one.
_IMAGENET_HEAD_MIN_SIZE = 64


class VGG11BN(SplittableModel):
    """VGG-11-BN in eight stages: five conv blocks, three classifier layers.

    Stages (cut ``k`` gives stages ``[0, k)`` to the client):

    0. ``block1``: ``conv3x3(C_in -> 64)-bn-relu [- maxpool]``
    1. ``block2``: ``conv3x3(64 -> 128)-bn-relu [- maxpool]``
    2. ``block3``: ``2 x conv3x3(-> 256)-bn-relu - maxpool``
    3. ``block4``: ``2 x conv3x3(-> 512)-bn-relu - maxpool``
    4. ``block5``: ``2 x conv3x3(-> 512)-bn-relu - maxpool``
    5. ``fc1``: ``adaptive avg pool - flatten - linear(-> hidden) - relu - dropout``
    6. ``fc2``: ``linear(hidden -> hidden) - relu - dropout``
    7. ``fc3``: ``linear(hidden -> num_classes)``

    At 224x224 with ``hidden=4096`` this is torchvision's ``vgg11_bn``
    (132,868,840 parameters for 1000 classes, 7.6 GMACs). Smaller inputs
    keep as many of the five max pools as fit, dropping the *earliest*
    ones: a 32x32 (or 28x28: the pools round up) input keeps all five and
    ends at 1x1, like CIFAR VGGs; an 8x8 input keeps the last three.

    Parameters
    ----------
    in_channels : int
        Input channels.
    image_size : int
        Height and width of the square input, at least 2.
    num_classes : int
        Number of output logits.
    hidden : int | None, optional
        Width of the two hidden classifier layers. Default ``None``: 4096 (the
        paper's) from 64x64 up, 512 below, where the features are only 512
        values and a 4096-wide classifier would hold 95% of the parameters.
    dropout : float, optional
        Dropout after ``fc1`` and ``fc2``. Default 0.5, the paper's.
    """

    def __init__(
        self,
        *,
        in_channels: int,
        image_size: int,
        num_classes: int,
        hidden: int | None = None,
        dropout: float = 0.5,
    ) -> None:
        check_dims(in_channels, image_size, num_classes)
        if image_size < 2:
            raise ValueError(f"VGG11BN needs image_size >= 2, got {image_size}")
        if hidden is None:
            hidden = 4096 if image_size >= _IMAGENET_HEAD_MIN_SIZE else 512
        # Pools round up (ceil_mode), so e.g. 28 -> 14 -> 7 -> 4 -> 2 -> 1.
        pools = min(len(_BLOCKS), math.ceil(math.log2(image_size)))
        skipped = len(_BLOCKS) - pools
        stages: list[nn.Module] = []
        prev, size = in_channels, image_size
        for index, widths in enumerate(_BLOCKS):
            layers: list[nn.Module] = []
            for width in widths:
                layers += [
                    nn.Conv2d(prev, width, 3, padding=1),
                    nn.BatchNorm2d(width),
                    nn.ReLU(),
                ]
                prev = width
            if index >= skipped:
                layers.append(nn.MaxPool2d(2, ceil_mode=True))
                size = math.ceil(size / 2)
            stages.append(nn.Sequential(*layers))
        pooled = min(_IMAGENET_POOLED, size)
        stages += [
            nn.Sequential(
                nn.AdaptiveAvgPool2d(pooled),
                nn.Flatten(),
                nn.Linear(prev * pooled * pooled, hidden),
                nn.ReLU(),
                nn.Dropout(dropout),
            ),
            nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout)),
            nn.Linear(hidden, num_classes),
        ]
        super().__init__(
            stages,
            input_shape=(in_channels, image_size, image_size),
            num_classes=num_classes,
        )
        self.stage_names = (
            "block1", "block2", "block3", "block4", "block5", "fc1", "fc2", "fc3"
        )
        self._init_weights()

    def _init_weights(self) -> None:
        """Torchvision's VGG init: He for convs, N(0, 0.01) for linear layers."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0, 0.01)
                nn.init.zeros_(module.bias)
