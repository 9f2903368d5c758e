"""Closed-form bytes per sample: the encodings' sizes and where FedAvg overtakes split learning."""

from __future__ import annotations

import pytest

from splitlearn.communication import (
    ARRAY_HEADER_BYTES,
    Sizes,
    bytes_per_sample,
    encoded_row_bytes,
    fedavg_break_even,
    split_bytes,
    split_with_tail_bytes,
    upload_only_bytes,
    whole_model_bytes,
)

SIZES = Sizes(cut_entries=2048, client_param_bytes=1280, model_param_bytes=638_504,
              client_arrays=2, model_arrays=10)


def test_row_sizes_per_encoding():
    assert encoded_row_bytes(2048) == 8192
    assert encoded_row_bytes(2048, "float16") == encoded_row_bytes(2048, "bfloat16") == 4096
    assert encoded_row_bytes(2048, "int8") == 2052
    # Half zeros: a bit per entry and a byte per non-zero one, plus the scale.
    assert encoded_row_bytes(2048, "int8", zero_fraction=0.5) == 256 + 1024 + 4
    # Too few zeros to pay for the mask: dense.
    assert encoded_row_bytes(2048, "int8", zero_fraction=0.05) == 2052
    assert encoded_row_bytes(2048, "topk", topk_fraction=0.1) == 205 * 4
    assert encoded_row_bytes(70_000, "topk", topk_fraction=0.1) == 7000 * 6  # 32-bit positions


def test_split_learning_per_sample_is_both_directions_the_label_and_the_weights():
    got = bytes_per_sample(split_bytes, SIZES, samples_per_client=100, local_epochs=2)
    assert got["data_plane"] == 8192 + 8 + 8192
    assert got["weights"] == pytest.approx(2 * (1280 + 2 * ARRAY_HEADER_BYTES) / 200)
    assert got["total"] == got["data_plane"] + got["weights"]
    local = bytes_per_sample(upload_only_bytes, SIZES, samples_per_client=100)
    assert local["data_plane"] == 8192 + 8  # no gradient comes back
    tail = Sizes(cut_entries=2048, client_param_bytes=1280, model_param_bytes=638_504,
                 tail_entries=64)
    with_tail = bytes_per_sample(split_with_tail_bytes, tail, samples_per_client=100,
                                 uplink="float16")
    assert with_tail["data_plane"] == 4096 + 8192 + 64 * 4 + 64 * 2  # no label; up is float16


def test_fedavg_and_splitfed_cost_the_same_at_the_break_even():
    n = fedavg_break_even(SIZES)
    fedavg = bytes_per_sample(whole_model_bytes, SIZES, samples_per_client=n)["total"]
    splitfed = bytes_per_sample(split_bytes, SIZES, samples_per_client=n)["total"]
    assert fedavg == pytest.approx(splitfed)
    assert bytes_per_sample(whole_model_bytes, SIZES, samples_per_client=2 * n)["total"] < (
        bytes_per_sample(split_bytes, SIZES, samples_per_client=2 * n)["total"])
    assert fedavg_break_even(SIZES, uplink="int8", downlink="int8") > 3.9 * n


def test_unknown_encodings_and_no_samples_are_refused():
    with pytest.raises(ValueError, match="unknown compression"):
        bytes_per_sample(split_bytes, SIZES, samples_per_client=10, uplink="zip")
    with pytest.raises(ValueError, match="need training samples"):
        bytes_per_sample(whole_model_bytes, SIZES, samples_per_client=0)
