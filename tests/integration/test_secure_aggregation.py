"""Secure aggregation (Flower's SecAgg+) and DP-FedAvg through the shipped apps.

The in-process runs (:func:`experiments.local.run_local`) call the real ClientApp
(with Flower's ``secaggplus_mod``) and the real strategy, whose grid runs Flower's
``SecAggPlusWorkflow`` stages; a recording grid keeps every reply the server gets.
Numerics are checked against the same run without masking: FedAvg of the unmasked
updates, within the quantisation error SecAgg+'s settings imply. Through an engine
(Flower's simulation runtime under ``flwr run``): tests/integration/test_flwr_run.py.
"""

from __future__ import annotations

import copy
import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Error, Message
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from experiments.local import LocalGrid, run_local
from protocols import compose_config
from strategies.privacy import update_epsilon
from tests.integration.test_simulation import read_clients

#: Small and exact enough: 4 devices of ~360 digits each, one round, one epoch.
BASE = ("logger=none", "strategy=fedavg", "num_clients=4", "strategy.num_rounds=1",
        "strategy.local_epochs=1", "aggregation.max_weight=400")


class RecordingGrid(LocalGrid):
    """A LocalGrid that keeps every reply the server receives, and can lose one node."""

    replies: list[Message] = []
    vanished: int | None = None  # this node never answers the message that carries weights

    def _deliver(self, message: Message) -> Message:
        if message.metadata.dst_node_id == self.vanished and "arrays" in message.content:
            return Message(Error(code=0, reason="node vanished"), reply_to=message)
        reply = super()._deliver(message)
        type(self).replies.append(copy.deepcopy(reply))  # as it left the node
        return reply


def run(tmp_path: Path, name: str, *overrides: str, vanished: int | None = None
        ) -> tuple[Path, list[Message]]:
    cfg = compose_config([*BASE, *overrides])
    cfg.run_dir = str(tmp_path / name)
    RecordingGrid.replies, RecordingGrid.vanished = [], vanished
    run_local(cfg, grid_type=RecordingGrid)
    return tmp_path / name, list(RecordingGrid.replies)


def weights(run_dir: Path) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in torch.load(run_dir / "model.pt").items()}


def quantisation_bound(run_dir: Path, *, clipping_range: float = 1.0,
                       quantization_range: int = 4194304, max_weight: float = 400) -> float:
    """Largest error of SecAgg+'s average per coordinate: a step per device, over the shares."""
    rows = [r for r in read_clients(run_dir) if r["status"] == "ok"]
    shares = sum(float(r["num_examples"]) / max_weight for r in rows)
    return len(rows) * (2 * clipping_range / quantization_range) / shares


def largest_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict[int | None, tuple[Path, list[Message]]]:
    """The unmasked references, run once: every node, and without node 3 (it vanishes)."""
    root = tmp_path_factory.mktemp("plain")
    return {vanished: run(root, f"without-{vanished}", vanished=vanished)
            for vanished in (None, 3)}


def test_secure_fedavg_equals_fedavg_and_the_server_never_holds_a_device_weights(
        tmp_path, plain):
    plain, plain_replies = plain[None]
    secure, secure_replies = run(tmp_path, "secure", "aggregation.secure=true")
    bound = quantisation_bound(secure)
    assert 0 < largest_difference(weights(secure), weights(plain)) <= bound + 1e-6
    # What the server received: unmasked, every device's weights; masked, no array at all,
    # only SecAgg+'s masked vectors (bytes) and the devices' metrics.
    assert all(r.content.array_records["arrays"] for r in plain_replies)
    assert all(not any(len(a) for a in r.content.array_records.values())
               for r in secure_replies)
    masked = [r for r in secure_replies
              if Key.MASKED_PARAMETERS in r.content.config_records.get(RECORD_KEY_CONFIGS, {})]
    assert len(masked) == 4
    assert [r["status"] for r in read_clients(secure)] == ["ok"] * 4


def test_a_node_that_vanishes_after_sharing_its_keys_is_unmasked_out_of_the_sum(
        tmp_path, plain):
    secure, _ = run(tmp_path, "secure", "aggregation.secure=true", vanished=3)
    # Node 3 shared its keys (stages 0, 1) then vanished: the others' pairwise masks with it
    # are rebuilt from its key shares, and the sum is the other three devices' FedAvg.
    assert largest_difference(weights(secure), weights(plain[3][0])) <= \
        quantisation_bound(secure) + 1e-6
    statuses = {r["node_id"]: r["status"] for r in read_clients(secure)}
    assert statuses["3"] == "failed" and sorted(statuses.values()).count("ok") == 3


def test_a_declining_device_adds_nothing_and_says_why(tmp_path):
    declined = ("failures.dropout_rate=0.3", "failures.dropout_after_steps=1")
    plain, _ = run(tmp_path, "plain", *declined)
    secure, _ = run(tmp_path, "secure", "aggregation.secure=true", *declined)
    statuses = [r["status"] for r in read_clients(secure)]
    assert statuses == [r["status"] for r in read_clients(plain)]
    assert "dropout" in statuses and "ok" in statuses
    assert largest_difference(weights(secure), weights(plain)) <= quantisation_bound(secure) + 1e-6


def test_updates_beyond_the_quantisation_range_are_refused_and_the_weights_kept(tmp_path):
    secure, _ = run(tmp_path, "secure", "aggregation.secure=true",
                    "aggregation.clipping_range=1e-6")
    rows = read_clients(secure)
    assert {r["status"] for r in rows} == {"failed"}
    assert all("aggregation.clipping_range" in r["reason"] for r in rows), rows[0]["reason"]
    with open(secure / "metrics.csv") as f:
        history = list(csv.DictReader(f))
    assert history[0]["test_loss"] == history[1]["test_loss"]  # nothing was averaged


def test_dp_fedavg_noise_has_the_std_of_sigma_clip_over_devices(tmp_path):
    clip = ("aggregation.secure=true", "aggregation.update_clip_norm=0.05",
            "aggregation.max_weight=1", "aggregation.clipping_range=0.1")
    clipped, _ = run(tmp_path, "clipped", *clip)
    noised, _ = run(tmp_path, "noised", *clip, "aggregation.update_noise_multiplier=2.0")
    # The same round with and without noise: the difference is the noise alone (plus
    # SecAgg+'s rounding, far below it), on every weight FedAvg averages.
    a, b = weights(clipped), weights(noised)
    diff = np.concatenate([(b[k] - a[k]).ravel() for k in a])
    assert diff.size > 10_000
    expected = 2.0 * 0.05 / 4
    assert abs(diff.std() / expected - 1) < 0.2
    with open(noised / "metrics.csv") as f:
        epsilon = float(list(csv.DictReader(f))[1]["update_epsilon"])
    assert epsilon == update_epsilon(noise_multiplier=2.0, releases=1, delta=1e-5)
    rows = read_clients(clipped)
    assert {r["status"] for r in rows} == {"ok"} and {r["update_weight"] for r in rows} == {"1.0"}


class DemandingGrid(LocalGrid):
    """Every node requires secure aggregation in its own config (its privacy floor)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        for context in self.contexts.values():
            context.node_config["privacy-secure-aggregation"] = True


def test_a_node_that_requires_secure_aggregation_refuses_a_round_without_it(tmp_path):
    for name, extra, status in (("plain", (), "privacy"),
                                ("secure", ("aggregation.secure=true",), "ok")):
        cfg = compose_config([*BASE, *extra])
        cfg.run_dir = str(tmp_path / name)
        run_local(cfg, grid_type=DemandingGrid)
        rows = read_clients(tmp_path / name)
        assert {r["status"] for r in rows} == {status}
        if status == "privacy":
            assert "requires secure aggregation" in rows[0]["reason"]


def corrupt(configs, change: str) -> None:
    """Spoil one field of a SecAgg+ reply the way a broken or hostile device might."""
    key, _, how = change.partition(":")
    if how == "drop":
        del configs[key]
    elif how == "type":
        configs[key] = 7
    elif how == "short":
        configs[key] = list(configs[key])[:-1]
    elif how == "stranger":
        configs[key] = [99, *list(configs[key])[1:]]
    elif how == "shape":
        configs[key] = [configs[key][0], b"\x93NUMPY garbage"]


class HostileGrid(LocalGrid):
    """Node 3 spoils its reply in one SecAgg+ stage."""

    stage, change = "", ""

    def _deliver(self, message: Message) -> Message:
        reply = super()._deliver(message)
        configs = message.content.config_records.get(RECORD_KEY_CONFIGS, {})
        if message.metadata.dst_node_id == 3 and configs.get(Key.STAGE) == self.stage:
            corrupt(reply.content.config_records[RECORD_KEY_CONFIGS], self.change)
        return reply


@pytest.mark.parametrize("stage, change, node_3_in_the_sum", [
    ("setup", f"{Key.PUBLIC_KEY_1}:drop", False),
    ("share_keys", f"{Key.CIPHERTEXT_LIST}:short", False),
    ("collect_masked_vectors", f"{Key.MASKED_PARAMETERS}:shape", False),
    ("collect_masked_vectors", f"{Key.MASKED_PARAMETERS}:short", False),
    ("unmask", f"{Key.NODE_ID_LIST}:stranger", True),
])
def test_a_malformed_secagg_reply_drops_its_node_and_the_round_goes_on(
        tmp_path, plain, stage, change, node_3_in_the_sum):
    HostileGrid.stage, HostileGrid.change = stage, change
    cfg = compose_config([*BASE, "aggregation.secure=true"])
    cfg.run_dir = str(tmp_path / "secure")
    run_local(cfg, grid_type=HostileGrid)
    # Refused before it reached Flower's workflow: it counts as a node that dropped out,
    # SecAgg+ recovers, and the others' average is what FedAvg of them gives.
    reference = plain[None if node_3_in_the_sum else 3][0]
    secure = tmp_path / "secure"
    assert largest_difference(weights(secure), weights(reference)) <= \
        quantisation_bound(reference) + 1e-6
    statuses = {r["node_id"]: r["status"] for r in read_clients(secure)}
    assert statuses["3"] == ("ok" if node_3_in_the_sum else "failed")


@pytest.mark.parametrize("strategy", ["splitfed_v1", "ushaped", "sglr", "local_loss"])
def test_every_averaging_split_protocol_trains_through_secagg_with_dp(tmp_path, strategy):
    """The same stages under each protocol's own round (its trunk side, its client arrays)."""
    cfg = compose_config(["logger=none", f"strategy={strategy}", "num_clients=3",
                          "strategy.num_rounds=1", "strategy.local_epochs=1",
                          "aggregation.secure=true", "aggregation.update_clip_norm=2",
                          "aggregation.update_noise_multiplier=0.1",
                          "aggregation.clipping_range=2", "aggregation.max_weight=1"])
    cfg.run_dir = str(tmp_path / strategy)
    RecordingGrid.replies, RecordingGrid.vanished = [], None
    run_local(cfg, grid_type=RecordingGrid)
    assert [r["status"] for r in read_clients(tmp_path / strategy)] == ["ok"] * 3
    # No device's weights reached the server: every array record it received is empty.
    assert all(not any(len(a) for a in r.content.array_records.values())
               for r in RecordingGrid.replies)
    with open(tmp_path / strategy / "metrics.csv") as f:
        assert float(list(csv.DictReader(f))[1]["update_epsilon"]) == update_epsilon(
            noise_multiplier=0.1, releases=1, delta=1e-5)
