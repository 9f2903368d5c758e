"""The data plane's public surface: wire constants as trunk.proto says, resumable streams."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import splitlearn.dataplane as dataplane
from protocols.splitfed import SplitFedV2Options
from server.standalone import build_trunk_side
from splitlearn.config import DataPlaneConfig
from splitlearn.dataplane import InProcessTransport, TrunkChannel, TrunkRejected
from splitlearn.stages import split
from tests.conftest import digits_like_model, fixed_batches

PROTO = Path(dataplane.__file__).with_name("trunk.proto").read_text()


def test_the_exported_method_name_is_the_one_trunk_proto_declares():
    package = re.search(r"^package ([\w.]+);", PROTO, re.M).group(1)
    service, method = re.search(r"service (\w+) \{\s*rpc (\w+)\(stream Request\)", PROTO).groups()
    assert dataplane.EXCHANGE_METHOD == f"/{package}.{service}/{method}"


def test_the_metadata_keys_are_named_in_trunk_proto_and_binary_where_they_carry_bytes():
    assert dataplane.TOKEN_METADATA_KEY in PROTO and dataplane.PROOF_METADATA_KEY in PROTO
    assert dataplane.PROOF_METADATA_KEY.endswith("-bin")  # gRPC's rule for binary values
    assert not dataplane.TOKEN_METADATA_KEY.endswith("-bin")


def trunk_and_batch():
    side = build_trunk_side(digits_like_model("cnn"), SplitFedV2Options(),
                            DataPlaneConfig(max_frame_bytes=1 << 20))
    token = side.tokens.issue(client="c0", protocol="splitfed_v2", cut=1, server_round=1,
                              ttl_s=60)
    x, y = fixed_batches(1, batch=4)[0]
    acts = split(digits_like_model("cnn"), 1)[0](x).detach()
    return side, token, acts, y


def test_a_fresh_channel_resumes_a_tokens_stream_above_its_last_sequence_number():
    side, token, acts, labels = trunk_and_batch()
    first = TrunkChannel(InProcessTransport(side.endpoint, token))
    first.forward(acts, labels)
    first.forward(acts, labels)
    first.close()
    assert first.last_seq == 2
    resumed = TrunkChannel(InProcessTransport(side.endpoint, token), last_seq=first.last_seq)
    grad, _, _ = resumed.forward(acts, labels)
    assert grad.shape == acts.shape and resumed.last_seq == 3 and side.trunk.steps == 3
    resumed.close()
    # Without it the new stream's first request repeats a sequence number: a replay.
    fresh = TrunkChannel(InProcessTransport(side.endpoint, token))
    with pytest.raises(TrunkRejected, match="REPLAYED"):
        fresh.forward(acts, labels)
    assert side.trunk.steps == 3


def test_a_negative_last_sequence_number_is_refused():
    side, token, _, _ = trunk_and_batch()
    with pytest.raises(ValueError, match="last_seq"):
        TrunkChannel(InProcessTransport(side.endpoint, token), last_seq=-1)


def test_the_trunks_step_is_the_whole_models():
    side, token, acts, labels = trunk_and_batch()
    reference = digits_like_model("cnn")
    top = split(reference, 1)[1]
    expected = acts.clone().requires_grad_()
    torch.nn.functional.cross_entropy(top(expected), labels).backward()
    channel = TrunkChannel(InProcessTransport(side.endpoint, token))
    grad, _, _ = channel.forward(acts, labels)
    assert torch.allclose(grad, expected.grad, atol=1e-6)
