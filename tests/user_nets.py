"""A user's own network, as a user would write it: plain ``nn.Module``, no stages."""

from __future__ import annotations

from torch import Tensor, nn


class TinyNet(nn.Module):
    """Conv -> pool -> MLP for 8x8 digits; knows nothing of split learning."""

    def __init__(self, hidden: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, hidden), nn.ReLU(),
                                  nn.Linear(hidden, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))
