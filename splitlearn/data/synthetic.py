"""A synthetic federated dataset of any size: every device generates its own data.

For scale: with 10,000 registered clients no real dataset here gives each one a
fixed share, and no client should have to build a global dataset to take its part.
In the spirit of LEAF's Synthetic dataset (Caldas et al. 2018), but with images a
convolutional bottom can take and one labelling for the whole federation, so that
one model can fit every device:

* per seed, a prototype ``P_c`` for each of the 10 classes: a 4x4 grid of
  N(0, 4) values, each spread over 2x2 pixels (a pattern with some spatial
  extent, which a convolutional bottom can pick up; pixel-level random patterns
  are nearly invisible to the SmallCNN's pooling);
* device ``k`` draws a shift ``v_k ~ N(0, skew)`` per pixel (its covariate shift:
  ``skew=0`` gives every device the same distribution); each of its examples has
  a uniformly drawn label ``y`` and the image ``sigmoid(P_y + v_k + 1.5 e)``, ``e``
  standard normal noise per pixel, so pixels lie in (0, 1).

Device ``k``'s data depends only on the seed and ``k``, so it costs the same whatever
the number of devices, and nothing is shared between them. The held-out test set is
drawn the same way from devices no client is (negative ids), so it is the same for
every federation size.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

SIDE = 8
FEATURES = SIDE * SIDE
CLASSES = 10
#: Devices and examples per device of the held-out test set.
TEST_DEVICES = 20
TEST_PER_DEVICE = 50


#: Standard deviation of the per-pixel noise around a class's prototype.
NOISE = 1.5
#: A prototype's values are spread over blocks of this many pixels a side.
BLOCK = 2


def _prototypes(seed: int) -> np.ndarray:
    grid = np.random.default_rng([seed, 0x5EED]).standard_normal(
        (CLASSES, SIDE // BLOCK, SIDE // BLOCK))
    return (2.0 * np.kron(grid, np.ones((BLOCK, BLOCK)))).reshape(CLASSES, FEATURES)


def device_examples(*, seed: int, device: int, samples: int, skew: float
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Return device ``device``'s ``samples`` images (float32, N x 1 x 8 x 8) and labels (int64).

    Raises
    ------
    ValueError
        For a negative sample count or skew.
    """
    if samples < 0:
        raise ValueError(f"dataset.samples_per_client={samples}: need at least 0")
    if skew < 0:
        raise ValueError(f"dataset.skew={skew}: need at least 0")
    # The device id is part of the seed: devices are independent of how many there are.
    rng = np.random.default_rng([seed, device + (1 << 40)])
    shift = rng.normal(0.0, np.sqrt(skew), FEATURES) if skew else np.zeros(FEATURES)
    labels = rng.integers(0, CLASSES, samples)
    z = _prototypes(seed)[labels] + shift + NOISE * rng.standard_normal((samples, FEATURES))
    x = 1.0 / (1.0 + np.exp(-z))
    return x.reshape(samples, 1, SIDE, SIDE).astype(np.float32), labels.astype(np.int64)


def synthetic_partition(*, seed: int, partition_id: int, samples: int, skew: float
                        ) -> TensorDataset:
    """Return a client's training data (its own device's examples)."""
    x, y = device_examples(seed=seed, device=partition_id, samples=samples, skew=skew)
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def synthetic_test(*, seed: int, skew: float) -> TensorDataset:
    """Return the held-out test set: examples of devices no client is."""
    parts = [device_examples(seed=seed, device=-1 - d, samples=TEST_PER_DEVICE, skew=skew)
             for d in range(TEST_DEVICES)]
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
