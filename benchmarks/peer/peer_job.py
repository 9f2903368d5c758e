"""The default job on the peer's side: the same SmallCNN, data and hyper-parameters.

Loaded by the peer's server and clients (their own environment: ``slwr`` on Flower
1.9). ``PEER_JOB`` names the file ``export_job.py`` wrote.
"""

import os

import torch
from torch import nn

JOB = torch.load(os.environ["PEER_JOB"], weights_only=False)
CUT, BATCH, EPOCHS, LR, MOMENTUM, ROUNDS, CLIENTS = 1, 32, 2, 0.05, 0.5, 20, 10
ADDRESS = "127.0.0.1:50071"


class SmallCNN(nn.Module):
    """The SmallCNN of splitlearn (digits 8x8, default widths), stage for stage, same weights."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList([
            nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveMaxPool2d(2)),
            nn.Sequential(nn.Flatten(), nn.Linear(512, 128), nn.ReLU()),
            nn.Linear(128, 10),
        ])
        self.load_state_dict(JOB["state"])

    def run(self, x: torch.Tensor, start: int, end: int | None = None) -> torch.Tensor:
        """Run stages ``[start, end)``."""
        for stage in self.stages[start:end]:
            x = stage(x)
        return x


def arrays(module: nn.Module) -> list:
    """Return ``module``'s state as NumPy arrays (Flower's parameters)."""
    return [v.detach().numpy().copy() for v in module.state_dict().values()]


def load(module: nn.Module, values: list) -> None:
    """Load NumPy arrays in :func:`arrays`' order into ``module``, in place."""
    state = {k: torch.from_numpy(v) for k, v in zip(module.state_dict(), values, strict=True)}
    module.load_state_dict(state)
