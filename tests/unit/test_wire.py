"""Client-side weights in Flower records: ``state_to_record`` / ``record_to_state``.

Data-plane frames are tested with the codec (splitlearn/dataplane); this is the
control plane's half of the wire: state dicts in ``ArrayRecord`` objects.
"""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord

from splitlearn.messages import record_to_state, state_to_record
from splitlearn.stages import bottom_state, load_bottom_state
from tests.conftest import digits_like_model, fixed_batches


def test_state_record_round_trip_keeps_buffers_and_dtypes():
    state = {"0.weight": torch.randn(3, 2), "0.num_batches_tracked": torch.tensor(7)}
    record = state_to_record(state)
    assert isinstance(record, ArrayRecord)
    back = record_to_state(record)
    assert list(back) == list(state)
    assert torch.equal(back["0.weight"], state["0.weight"])
    assert back["0.num_batches_tracked"].dtype == torch.int64
    assert back["0.num_batches_tracked"].shape == ()
    assert int(back["0.num_batches_tracked"]) == 7


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(2, 3),
        torch.randn(4).half(),
        torch.randn(2, 2).double(),
        torch.arange(5, dtype=torch.int32),
        torch.arange(5),
        torch.tensor([True, False]),
        torch.zeros(0, 3),
        torch.tensor(2.5),
    ],
    ids=["float32", "float16", "float64", "int32", "int64", "bool", "empty", "scalar"],
)
def test_every_dtype_and_shape_survives_the_round_trip(tensor):
    back = record_to_state(state_to_record({"t": tensor}))["t"]
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_a_models_state_with_batch_norm_buffers_loads_back_exactly():
    model = digits_like_model("resnet")
    model.train()
    with torch.no_grad():
        model(fixed_batches(1, batch=8)[0][0])  # move the running statistics off their init
    state = bottom_state(model, 3)
    buffers = [k for k in state if "running_" in k or "num_batches_tracked" in k]
    assert buffers  # the bottom holds batch-norm buffers
    back = record_to_state(state_to_record(state))
    assert back.keys() == state.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in state.items())
    other = digits_like_model("resnet", seed=1)
    load_bottom_state(other, back)
    assert all(torch.equal(other.state_dict()[f"stages.{k}"], v) for k, v in state.items())


def test_parameters_are_detached_and_decoded_tensors_are_independent():
    model = digits_like_model("cnn")
    params = dict(model.stages[0].named_parameters())
    record = state_to_record(params)  # requires_grad tensors are accepted ...
    first = record_to_state(record)
    assert not any(t.requires_grad for t in first.values())  # ... and come back as data
    first["0.weight"].add_(1)  # writable, and owning its memory
    again = record_to_state(record)
    assert torch.equal(again["0.weight"], params["0.weight"].detach())
    with torch.no_grad():
        params["0.weight"].mul_(2)  # the record does not follow the model either
    assert torch.equal(record_to_state(record)["0.weight"], again["0.weight"])


def test_non_contiguous_tensors_round_trip():
    t = torch.randn(4, 3).t()
    assert not t.is_contiguous()
    assert torch.equal(record_to_state(state_to_record({"t": t}))["t"], t)
