"""The client step exported to ExecuTorch trains as eager PyTorch does, against a real trunk.

The reference is the eager split client (``SplitStep``) on the same batches against a
trunk of its own: after several steps both clients' weights and both trunks agree.
``lenet5``'s bottom ends in MaxPool2d, whose backward ExecuTorch's portable kernel got
wrong (see :mod:`clients.executorch_step`).
"""

from __future__ import annotations

import copy

import pytest
import torch

from clients.executorch_step import ExecuTorchClientStep, export_client_step
from splitlearn.split import split
from tests.conftest import digits_like_model, fixed_batches
from tests.helpers import max_param_diff, train_split_client

LR = 0.1
STEPS = 8
BATCH = 16
TOLERANCE = 1e-5


@pytest.mark.parametrize("name", ["cnn", "lenet5"])
def test_executorch_client_trains_as_eager_pytorch(trunk_server_factory, name):
    reference = digits_like_model(name)
    batches = fixed_batches(STEPS, batch=BATCH)
    eager_server = trunk_server_factory(reference, lr=LR)
    eager_client = copy.deepcopy(reference)
    channel = eager_server.channel(eager_server.token(1))
    train_split_client(eager_client, 1, batches, channel, lr=LR)
    channel.close()

    et_server = trunk_server_factory(reference, lr=LR)
    device = ExecuTorchClientStep(export_client_step(reference, 1, batch_size=BATCH), lr=LR)
    channel = et_server.channel(et_server.token(1))
    for x, y in batches:
        gradient, _, _ = channel.forward(device.activations(x), y)
        device.train(x, gradient)
    channel.close()

    bottom, _ = split(eager_client, 1)
    mine = device.state_dict()
    for key, value in bottom.state_dict().items():
        assert (mine[key].reshape(value.shape) - value).abs().max() <= TOLERANCE, key
    assert max_param_diff(et_server.model, eager_server.model) <= TOLERANCE


def test_the_program_refuses_a_batch_of_another_shape():
    reference = digits_like_model("cnn")
    device = ExecuTorchClientStep(export_client_step(reference, 1, batch_size=BATCH), lr=LR)
    with pytest.raises(ValueError, match=r"batches of shape \(16, 1, 8, 8\), got \(4, 1, 8, 8\)"):
        device.activations(torch.zeros(4, 1, 8, 8))
