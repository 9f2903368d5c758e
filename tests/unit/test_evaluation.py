"""Central evaluation: the channels-last path measures the same model the standard one does."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from splitlearn.evaluation import evaluate_model, intra_op_threads, usable_cores
from splitlearn.models import build_model


@pytest.mark.parametrize(("name", "channels", "size"), [("cnn", 1, 8), ("resnet", 3, 16)])
def test_channels_last_evaluation_equals_the_standard_one(name: str, channels: int,
                                                          size: int) -> None:
    torch.manual_seed(0)
    model = build_model(name, in_channels=channels, image_size=size, num_classes=10)
    batches = [(torch.randn(40, channels, size, size), torch.randint(0, 10, (40,)))
               for _ in range(3)]
    loss, accuracy, examples = evaluate_model(model, batches)
    converted = copy.deepcopy(model).to(memory_format=torch.channels_last)
    assert converted.stages[0][0].weight.is_contiguous(memory_format=torch.channels_last)
    cl_loss, cl_accuracy, cl_examples = evaluate_model(converted, batches, channels_last=True)
    assert (cl_accuracy, cl_examples) == (accuracy, examples) and examples == 120
    assert cl_loss == pytest.approx(loss, rel=1e-5)


def test_intra_op_threads_are_restored_also_when_the_block_fails() -> None:
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    with pytest.raises(RuntimeError, match="failed"), intra_op_threads(other):
        assert torch.get_num_threads() == other
        raise RuntimeError("failed")
    assert torch.get_num_threads() == before
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)
