"""Scikit-learn's handwritten digits as HuggingFace datasets.

The digits data (1797 grey 8x8 images, 10 classes) ships inside scikit-learn, so
it needs no download and makes experiments and tests run offline in seconds.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # HF datasets takes about a second to import: only where digits load
    import datasets

DIGITS_IMAGE_SIZE = 8
DIGITS_NUM_CLASSES = 10
# Pixel intensities in sklearn's digits are integers in [0, 16].
_DIGITS_MAX_PIXEL = 16.0


# Built once per process and split: a client rebuilds its partition every round, and
# wrapping the arrays in arrow took ~75 ms of each client's round.
@functools.lru_cache(maxsize=8)
def load_digits_splits(
    *, test_fraction: float = 0.2, seed: int = 0
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Load the digits data as a stratified, seeded train/test split.

    The result is cached per process: treat both datasets as read-only
    (``with_format`` and ``select`` return new datasets; ``set_format`` would
    change the cached one).

    Parameters
    ----------
    test_fraction : float, optional
        Fraction of the 1797 samples held out for testing, in (0, 1).
    seed : int, optional
        ``random_state`` of the split; the same seed gives an identical split.

    Returns
    -------
    tuple[datasets.Dataset, datasets.Dataset]
        ``(train, test)``. Both have the columns ``"image"`` (an ``Array2D``
        feature of shape (8, 8), float32 in [0, 1], i.e. an 8x8 nested list per
        row) and ``"label"`` (int64 in 0..9).

    Raises
    ------
    ValueError
        If ``test_fraction`` is not strictly between 0 and 1.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    # scikit-learn's model_selection imports its metrics (seconds): only where digits load.
    from sklearn.model_selection import train_test_split

    images, labels = _load_scaled_digits()
    train_x, test_x, train_y, test_y = train_test_split(
        images,
        labels,
        test_size=test_fraction,
        stratify=labels,
        random_state=seed,
    )
    return _to_hf_dataset(train_x, train_y), _to_hf_dataset(test_x, test_y)


def _load_scaled_digits() -> tuple[np.ndarray, np.ndarray]:
    """Return digits images as float32 (N, 8, 8) in [0, 1] and int64 labels."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images / _DIGITS_MAX_PIXEL).astype(np.float32)
    return images, bunch.target.astype(np.int64)


def _digits_features() -> datasets.Features:
    """Describe the digits columns so arrow stores them typed, not as lists."""
    import datasets

    shape = (DIGITS_IMAGE_SIZE, DIGITS_IMAGE_SIZE)
    return datasets.Features(
        {
            "image": datasets.Array2D(shape=shape, dtype="float32"),
            "label": datasets.Value("int64"),
        }
    )


def _to_hf_dataset(images: np.ndarray, labels: np.ndarray) -> datasets.Dataset:
    """Wrap image and label arrays in a HuggingFace dataset."""
    import datasets

    return datasets.Dataset.from_dict(
        {"image": images, "label": labels}, features=_digits_features()
    )
