"""A phone's round: what the web runtime cannot train is refused, its task and result checked.

``devices.web=true`` refuses a run a phone could not train before it starts (naming the
key and the layer); a phone's node refuses such a round again (a DeviceFailure). The task
a ClientApp hands a phone carries the batches a Python device of the same partition would
train, and a phone's result is loaded only when it is what the task asked for. The
gateway's join tokens are its own and expire. (The phones themselves, in Chromium, are
tests/integration/test_gateway.py's.)
"""

from __future__ import annotations

import copy
import gzip
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from clients.device import DeviceFailure
from clients.gateway import JoinRefused, JoinTokens
from clients.loop import epoch_loader
from clients.steps.web import (
    classes_seen,
    finish_on_phone,
    own_examples,
    phone_task,
    web_step_type,
)
from protocols import PROTOCOLS, check_config, compose_config, protocol_named
from splitlearn.config import PrivacyConfig, RunSpec
from splitlearn.web import encode_tensor
from tests.conftest import digits_like_model

WEB = ["devices.web=true", "dataplane.websocket_port=0"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("overrides", "message"), [
    (["dataplane.websocket_port=null"], "set dataplane.websocket_port"),
    (["strategy=local_loss"], "strategy=local_loss has another"),
    (["strategy=fedavg"], "strategy=fedavg has another"),
    (["privacy=dpsgd_client", "privacy.noise_multiplier=1.0"], "privacy=dpsgd_client"),
    (["privacy.nopeek_weight=0.1"], "nopeek_weight=0.1"),
    (["strategy=ushaped", "privacy.gradient_noise_multiplier=0.5"],
     "gradient_noise_multiplier=0.5"),
    (["compression=int8"], "dense float32 frames"),
    (["planner=smartsplit"], "with activation recomputation"),
    (["model=vit"], "model=vit at cut 2: the web runtime cannot run layer 0 (0: PatchEmbedding)"),
], ids=["no-websocket", "local-loss", "fedavg", "dpsgd", "nopeek", "gradient-noise",
        "compression", "recomputing-planner", "unsupported-layer"])
def test_what_a_phone_cannot_train_is_refused_before_the_run(overrides, message):
    with pytest.raises(ValueError) as err:
        check_config(compose_config([*WEB, *overrides]))
    assert message in str(err.value)
    assert "devices.web=true" in str(err.value)


@pytest.mark.parametrize("overrides", [
    [], ["strategy=splitfed_v1"], ["strategy=sglr"], ["strategy=sequential"],
    ["strategy=ushaped"], ["model=lenet5"], ["model=resnet"], ["+privacy.label_epsilon=2.0"],
    ["planner=dynsl"], ["privacy=activation_gaussian", "privacy.noise_multiplier=0.5"],
], ids=["splitfed-v2", "splitfed-v1", "sglr", "sequential", "ushaped", "lenet5",
        "resnet-first-stage", "label-dp", "dynsl", "activation-noise"])
def test_what_a_phone_can_train_is_accepted(overrides):
    check_config(compose_config([*WEB, *overrides]))


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_a_phones_node_refuses_a_protocol_the_web_runtime_does_not_run(name):
    protocol = protocol_named(name)
    if "web" in protocol.capabilities.runtimes:
        assert web_step_type(protocol, RunSpec(), recompute=False) is protocol.client
    else:
        with pytest.raises(DeviceFailure, match=f"strategy={name}"):
            web_step_type(protocol, RunSpec(), recompute=False)
    with pytest.raises(DeviceFailure, match="privacy=dpsgd_client"):
        web_step_type(protocol_named("splitfed_v2"),
                      RunSpec(privacy=PrivacyConfig("dpsgd_client", noise_multiplier=1.0)),
                      recompute=False)


def split_step(protocol: str = "splitfed_v2", cut: int = 2):  # noqa: ANN201
    spec = RunSpec(strategy=protocol_named(protocol).options())
    return protocol_named(protocol).client(digits_like_model(), spec, cut=cut), spec


def digits_data(n: int = 50) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=generator),
                         torch.randint(0, 10, (n,), generator=generator))


def task_for(step, spec, protocol: str = "splitfed_v2", **kw):  # noqa: ANN001, ANN201
    loader = epoch_loader(digits_data(), spec, server_round=3, partition_id=1)
    return phone_task(step, protocol_named(protocol), loader, server_round=3,
                      trunk={"url": "ws://127.0.0.1:1", "token": "t", "proof": None},
                      epochs=2, max_steps=kw.get("max_steps"), holds=kw.get("holds"))


def test_the_task_carries_the_batches_a_python_device_trains_in_its_order():
    step, spec = split_step()
    task = task_for(step, spec)
    loader = epoch_loader(digits_data(), spec, server_round=3, partition_id=1)
    python = [labels.tolist() for _ in range(2) for _, labels in loader]
    labels = task["data"]["labels"]
    assert [[labels[i] for i in batch] for batch in task["batches"]] == python
    assert len(task_for(step, spec, max_steps=3)["batches"]) == 3
    # A phone that holds this partition gets the task without its rows; one that holds
    # another partition (or none) gets them.
    held = task_for(step, spec, holds=task["data"]["id"])["data"]
    assert held == {"id": task["data"]["id"], "shape": [50, 1, 8, 8]}
    assert "inputs" in task_for(step, spec, holds="another")["data"]
    # The head's stages under the model's own keys; a U-shaped task adds the tail.
    assert set(task["parts"][0]["state"]) == {k for k in step.state() if k[0] in "01"}
    ushaped, uspec = split_step("ushaped")
    parts = task_for(ushaped, uspec, "ushaped")["parts"]
    assert len(parts) == 2 and set(parts[0]["state"]) | set(parts[1]["state"]) == set(
        ushaped.state())


def test_the_task_asks_for_the_release_the_privacy_option_makes():
    step, spec = split_step()
    assert task_for(step, spec)["release"] is None
    noisy = RunSpec(privacy=PrivacyConfig("activation_gaussian", clip_norm=2.0,
                                          noise_multiplier=0.5))
    step = protocol_named("splitfed_v2").client(digits_like_model(), noisy, cut=2)
    assert task_for(step, noisy)["release"] == {"clip_norm": 2.0, "noise_std": 1.0}


def phone_result(task: dict, *, scale: float = 0.5, **metrics) -> dict:
    """What an honest page returns: each part's tensors (scaled: trained), its measurements."""
    states = [{"tensors": {k: encode_tensor(scale * torch.ones(v["shape"]))
                           for k, v in part["state"].items()},
               "counters": dict(part.get("counters", {}))} for part in task["parts"]]
    return {"states": states, "metrics": {
        "steps": 4, "examples": 40, "loss_sum": 80.0, "correct": 10, "compute_s": 0.1,
        "wait_s": 0.2, "wall_s": 0.4, "bytes_up": 100, "bytes_down": 90, "peak_bytes": 5000,
        "backend": "cpu"} | metrics}


def test_a_phones_trained_stages_load_into_the_model_it_replies_with():
    step, spec = split_step()
    task = task_for(step, spec)
    done = finish_on_phone(step, task, phone_result(task))
    assert done["steps"] == 4 and step.peak_memory_bytes == 5000
    assert all(torch.equal(v, 0.5 * torch.ones_like(v)) for v in step.state().values())


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r["states"].pop(), "part states expected"),
    (lambda r: r["states"][0]["tensors"].popitem(), "keys and shapes"),
    (lambda r: r["states"][0]["tensors"].update(
        {"9.weight": encode_tensor(torch.ones(2))}), "keys and shapes"),
    (lambda r: next(iter(r["states"][0]["tensors"].values())).update(
        encode_tensor(torch.ones(3, 3))), "keys and shapes"),
    (lambda r: next(iter(r["states"][0]["tensors"].values())).update(
        encode_tensor(torch.full_like(torch.ones(1), float("nan")))), "keys and shapes"),
    (lambda r: r["metrics"].update(steps=10_000), "more than the task's"),
    (lambda r: r["metrics"].update(correct=41), "more correct"),
    (lambda r: r["metrics"].update(compute_s=float("inf")), "compute_s"),
    (lambda r: r["metrics"].update(bytes_up=-1), "bytes_up"),
    (lambda r: r["metrics"].pop("wait_s"), "wait_s"),
    (lambda r: r.update(metrics="fast"), "no metrics"),
], ids=["part-missing", "key-missing", "key-added", "shape", "nan-shape", "steps", "correct",
        "infinite", "negative", "metric-missing", "not-an-object"])
def test_a_result_that_is_not_what_the_task_asked_for_loads_nothing(change, message):
    step, spec = split_step()
    task = task_for(step, spec)
    result = phone_result(task)
    change(result)
    before = copy.deepcopy(step.state())
    with pytest.raises(DeviceFailure, match=message):
        finish_on_phone(step, task, result)
    assert all(torch.equal(before[k], v) for k, v in step.state().items())


def test_a_non_finite_trained_weight_loads_nothing():
    step, spec = split_step()
    task = task_for(step, spec)
    before = copy.deepcopy(step.state())
    with pytest.raises(DeviceFailure, match="is not finite"):
        finish_on_phone(step, task, phone_result(task, scale=float("inf")))
    assert all(torch.equal(before[k], v) for k, v in step.state().items())


def test_a_phone_with_its_own_pictures_gets_a_task_without_rows_and_counts_its_classes():
    step, spec = split_step()
    task = task_for(step, spec, holds="own:50:0a1b2c3d")
    assert task["data"] == {"id": "own:50:0a1b2c3d", "shape": [50, 1, 8, 8], "own": True,
                            "light_on_dark": True, "classes": 10}
    assert sorted(i for batch in task["batches"][:2] for i in batch) == list(range(50))
    assert classes_seen(task, phone_result(task, classes=7)) == 7
    for claimed in (0, 11, 2.5, "7", None, True):  # beyond the study's classes, or not a count
        with pytest.raises(DeviceFailure, match="span"):
            classes_seen(task, phone_result(task, classes=claimed))
    assert classes_seen(task_for(step, spec), phone_result(task)) is None  # assigned data


@pytest.mark.parametrize(("held", "count"), [
    (None, None), ("0123abcd" * 4, None), ("own:1:00000000", 1), ("own:2000:ffffffff", 2000),
])
def test_what_a_phone_holds_says_whether_it_trains_its_own_pictures(held, count):
    assert own_examples(held) == count


@pytest.mark.parametrize("held", ["own:0:00", "own:2001:00", "own:-3:00", "own:ten:00",
                                  "own:5", "own:5:a:b", "own::", "own:\u00b2:00", "own: 5:00"])
def test_a_phone_claiming_no_or_too_many_pictures_is_refused(held):
    with pytest.raises(DeviceFailure, match="own pictures are own:<1 to 2000>"):
        own_examples(held)


def test_join_tokens_are_the_gateways_own_and_expire():
    tokens = JoinTokens(ttl_s=60)
    token = tokens.issue(now=1000.0)
    tokens.check(token, now=1059.0)
    with pytest.raises(JoinRefused, match="expired"):
        tokens.check(token, now=1061.0)
    expiry, nonce, mac = token.split(".")
    for forged in [f"{int(expiry) + 3600}.{nonce}.{mac}", f"{expiry}.{nonce}.{'0' * 32}",
                   JoinTokens(ttl_s=60).issue(now=1000.0), "", None, 42, "a.b", "x.y.z"]:
        with pytest.raises(JoinRefused, match="not this gateway's"):
            tokens.check(forged, now=1001.0)


def test_the_gateway_refuses_strangers_and_serves_only_its_page(tmp_path):
    import json
    import urllib.error
    import urllib.request

    from websockets.exceptions import ConnectionClosedError
    from websockets.sync.client import connect

    from clients.gateway import Gateway, parse_args
    from clients.relay import PhoneFailed, delegate, holding

    gateway = Gateway(parse_args(["--superlink", "127.0.0.1:1", "--insecure", "--phones", "1",
                                  "--port", "0", "--logs", str(tmp_path)]))
    gateway.start()
    base = f"127.0.0.1:{gateway.port}"
    try:
        for hello, reason in [("garbage", "reads a JSON hello"),
                              (json.dumps({"slot": 0, "secret": "guess"}), "relay secret"),
                              (json.dumps({"slot": 7, "secret": gateway.relay_secret}),
                               "no slot 7")]:
            with connect(f"ws://{base}/relay") as link:
                link.send(hello)
                with pytest.raises(ConnectionClosedError, match=reason):
                    link.recv(timeout=5)
        # A ClientApp whose phone is not connected hears so at once (its row: unavailable).
        with pytest.raises(PhoneFailed, match="no phone holds place 0") as failed:
            delegate(f"ws://{base}/relay", slot=0, secret=gateway.relay_secret,
                     task=lambda holds: {"data": {}}, timeout_s=5)
        assert failed.value.kind == "unavailable"
        with pytest.raises(PhoneFailed, match="no phone holds place 0") as failed:
            holding(f"ws://{base}/relay", slot=0, secret=gateway.relay_secret, timeout_s=5)
        assert failed.value.kind == "unavailable"
        with connect(f"ws://{base}/phone") as page:  # a page without a token
            page.send(json.dumps({"join": "1.2.3"}))
            with pytest.raises(ConnectionClosedError, match="not this gateway's"):
                page.recv(timeout=5)
        assert urllib.request.urlopen(f"http://{base}/").status == 200
        # The bundle travels gzipped to a browser that takes it, and as it is to one that not.
        bundle = (ROOT / "web" / "dist" / "page.js").read_bytes()
        asked = urllib.request.Request(f"http://{base}/page.js",
                                       headers={"Accept-Encoding": "gzip, deflate"})
        with urllib.request.urlopen(asked) as served:
            assert served.headers["Content-Encoding"] == "gzip"
            assert gzip.decompress(served.read()) == bundle
        with urllib.request.urlopen(f"http://{base}/page.js") as served:
            assert served.headers["Content-Encoding"] is None and served.read() == bundle
        for path in ("/etc/passwd", "/../web/package.json", "/relay.py"):
            with pytest.raises(urllib.error.HTTPError, match="404"):
                urllib.request.urlopen(f"http://{base}{path}")
    finally:
        gateway.stop()
