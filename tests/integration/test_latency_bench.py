"""The latency suite's servers, in this process and in one of their own, answer as measured."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from benchmarks.latency import (
    BATCH,
    PAYLOADS,
    RawEchoClient,
    measure_payload,
    running_servers,
)
from splitlearn.config import DataPlaneConfig
from splitlearn.dataplane import GrpcTransport, TrunkChannel


@pytest.mark.parametrize("own_process", [True, False], ids=["two-processes", "one-process"])
def test_both_stacks_echo_what_they_were_sent(own_process):
    dataplane = DataPlaneConfig()
    with running_servers(dataplane, own_process=own_process) as addresses:
        assert len(addresses["tokens"]) == len(PAYLOADS)
        shape = PAYLOADS[0][1]
        channel = TrunkChannel(GrpcTransport(addresses["data_plane"], addresses["tokens"][0]))
        acts, labels = torch.rand(BATCH, *shape), torch.randint(0, 10, (BATCH,))
        try:
            grad, _, _ = channel.forward(acts, labels)
        finally:
            channel.close()
        torch.testing.assert_close(grad, acts, rtol=0, atol=0)  # the session echoes the batch
        raw = RawEchoClient(addresses["raw"], dataplane.max_frame_bytes)
        try:
            assert raw.round_trip(b"\x01" * 1000) == b"\x01" * 1000
        finally:
            raw.close()
        # A token's session counts its frames: the measured payload is another token's.
        size, ours, theirs = measure_payload(1, addresses, dataplane, blocks=1, block=3)
        assert size > BATCH * 8 * 1024 and ours > 0 and theirs > 0
    assert not multiprocessing.active_children()  # the server process is gone
