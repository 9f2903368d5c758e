"""The data plane across a real shaped link: two network namespaces, a veth pair, ``tc tbf``.

The trunk service runs in a fresh "server" namespace, one client round of the shipped
loop (``TrunkChannel`` over gRPC) in a fresh "device" namespace; each direction of the
veth between them is shaped by ``tbf``; a second test adds a round-trip time with the
delay relay in the device namespace (the latency ``tc netem`` would add). The machine's
own namespace is never changed, and the namespaces (with the veth and every process in
them) are deleted at the end. Skipped where namespaces, veth or ``tbf`` are unavailable
(e.g. not root).
"""

from __future__ import annotations

import math
import subprocess

import pytest

from benchmarks.netns import ShapedLink, dataplane_round, unavailable_reason

UPLINK_MBPS, DOWNLINK_MBPS = 8.0, 20.0
MBIT = 1e6 / 8  # bytes per second in one Mbit/s

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None,
                                reason=f"shaped network namespaces unavailable: {REASON}")


def namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.strip()}


def test_a_client_trains_across_a_shaped_veth_no_faster_than_its_links(tmp_path):
    link = ShapedLink(UPLINK_MBPS, DOWNLINK_MBPS)
    with link:
        assert {link.server, link.device} <= namespaces()
        report, books = dataplane_round(link, ["logger=none"], folder=tmp_path)
    assert not {link.server, link.device} & namespaces()  # gone, and the veth with them

    # The trunk stepped on every batch the client sent, over the link.
    assert report["steps"] == books["steps"] == 10  # 144 examples, batch 32, 2 epochs
    assert report["examples"] == books["samples"] == 288
    assert math.isfinite(report["loss"]) and 0 < report["loss"] < 10
    assert 0.0 <= report["accuracy"] <= 1.0
    assert report["bytes_up"] > 2 * 2**20 and report["bytes_down"] > 2 * 2**20
    # The shaping is real: the bytes cannot cross faster than the links carry them (a
    # lower bound with room for tbf's 4 KiB bucket; a slow host only makes it slower).
    link_s = report["bytes_up"] / (UPLINK_MBPS * MBIT) + report["bytes_down"] / (
        DOWNLINK_MBPS * MBIT)
    assert report["wait_s"] >= 0.8 * link_s
    assert report["wall_s"] >= report["wait_s"]


def test_through_the_delay_relay_every_batch_also_pays_the_round_trip(tmp_path):
    # 200 ms: ten batches then wait 2 s more than the link's 3.3 s, so the bound below
    # holds only if the delay is really paid (the shaping alone meets 0.8x a 20 ms one).
    rtt_s = 0.2
    link = ShapedLink(UPLINK_MBPS, DOWNLINK_MBPS)
    with link:
        report, books = dataplane_round(link, ["logger=none"], folder=tmp_path, rtt_s=rtt_s)
        # The relay is gone with the round, not only with the namespace.
        left = subprocess.run(["ip", "netns", "pids", link.device], capture_output=True,
                              text=True).stdout.split()
        assert left == []
    assert not {link.server, link.device} & namespaces()

    assert report["steps"] == books["steps"] == 10
    assert report["examples"] == books["samples"] == 288
    assert math.isfinite(report["loss"]) and 0 < report["loss"] < 10
    # Each batch is one exchange (activations up, gradient down): it waits for the link
    # to carry its bytes and for the relay's delay both ways (a lower bound, as above).
    link_s = report["bytes_up"] / (UPLINK_MBPS * MBIT) + report["bytes_down"] / (
        DOWNLINK_MBPS * MBIT)
    assert report["wait_s"] >= 0.8 * (link_s + report["steps"] * rtt_s)
    assert report["wall_s"] >= report["wait_s"]
