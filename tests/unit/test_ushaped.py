"""What is specific to the U-shaped protocol: cuts, client state, frames, grants, strategy."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.supercore.task_identity import TaskIdentity

from clients.device import MemoryBudgetExceeded
from clients.ushaped import (
    EXCHANGES_PER_BATCH,
    EmulatedUShapedSession,
    check_ushaped_memory,
    train_ushaped,
    ushaped_memory_bytes,
)
from server.app import PROTOCOLS, make_task_template
from server.trunk_service import TokenRegistry
from splitlearn.calibration import client_train_memory_bytes
from splitlearn.config import compose_config
from splitlearn.planning.devices import DeviceProfile
from splitlearn.split import (
    load_bottom_state,
    resolve_tail_cut,
    split,
    split_u,
    stages_state,
    ushaped_state,
)
from splitlearn.task import SplitTask
from splitlearn.transport import TrunkRejected
from splitlearn.wire import (
    FrameError,
    check_backward_frame,
    check_label_free,
    decode_frame,
    encode_frame,
    record_to_state,
)
from strategies.ushaped import UShapedSplit
from tests.conftest import digits_like_model, fixed_batches
from tests.unit.test_splitfed import TASK

LIMIT = 1 << 20


@pytest.fixture(autouse=True)
def run_identity(monkeypatch):
    monkeypatch.setattr(TaskIdentity, "_run_id", 1, raising=False)
    monkeypatch.setattr(TaskIdentity, "_node_id", 1, raising=False)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1, raising=False)


# --- cuts and client state -------------------------------------------------


def test_tail_cut_zero_means_the_last_stage_and_bad_pairs_name_both_cuts():
    model = digits_like_model("cnn")  # 5 stages
    assert resolve_tail_cut(model, 1, 0) == 4
    assert resolve_tail_cut(model, 2, 3) == 3
    for cut, tail_cut in [(2, 2), (3, 2), (1, 5), (4, 0)]:
        with pytest.raises(ValueError, match=f"cut={cut}, tail_cut={tail_cut}; need cut < tail"):
            resolve_tail_cut(model, cut, tail_cut)
    with pytest.raises(ValueError, match="invalid cut 0"):
        resolve_tail_cut(model, 0, 3)


def test_split_u_parts_share_the_model_and_join_to_the_whole():
    model = digits_like_model("resnet").eval()
    head, trunk, tail = split_u(model, 1, 3)
    assert (len(head), len(trunk), len(tail)) == (1, 2, 2)
    assert head[0] is model.stages[0] and tail[0] is model.stages[3]
    x = fixed_batches(1, batch=4)[0][0]
    with torch.no_grad():
        assert torch.equal(tail(trunk(head(x))), model(x))


def test_ushaped_state_holds_head_and_tail_under_stage_keys_and_loads_back():
    model = digits_like_model("cnn")
    state = ushaped_state(model, 1, 3)
    assert {int(k.split(".")[0]) for k in state} == {0, 3, 4}
    assert state.keys() == stages_state(model, [0, 3, 4]).keys()
    other = digits_like_model("cnn", seed=1)
    load_bottom_state(other, state)
    for i in (0, 3, 4):
        for a, b in zip(other.stages[i].parameters(), model.stages[i].parameters(), strict=True):
            assert torch.equal(a, b)
    assert not torch.equal(other.stages[1][0].weight, model.stages[1][0].weight)


def test_ushaped_memory_adds_the_tail_to_the_head():
    model = digits_like_model("cnn")
    head_only = client_train_memory_bytes(model, 1, batch_size=32)
    assert ushaped_memory_bytes(model, 1, 0, batch_size=32) > head_only


# --- frames ----------------------------------------------------------------


def test_label_free_frames_refuse_labels_and_any_other_tensor():
    acts, labels = torch.ones(2, 3), torch.zeros(2, dtype=torch.int64)
    ok = decode_frame(encode_frame("forward", {"activations": acts}), max_bytes=LIMIT)
    check_label_free(ok, allowed=("activations",))
    both = decode_frame(
        encode_frame("forward", {"activations": acts, "labels": labels}), max_bytes=LIMIT
    )
    with pytest.raises(FrameError, match="keep labels on the device.*\\['labels'\\]"):
        check_label_free(both, allowed=("activations",))


@pytest.mark.parametrize(
    ("tensors", "why"),
    [
        ({}, "no 'grad' tensor"),
        ({"grad": torch.ones(2, 5)}, "shape \\(2, 5\\); expected \\(2, 4\\)"),
        ({"grad": torch.ones(2, 4, dtype=torch.int64)}, "float dtype"),
        ({"grad": torch.tensor([[1.0, float("inf"), 0, 0]] * 2)}, "NaN or infinite"),
        ({"grad": torch.ones(2, 4), "labels": torch.zeros(2, dtype=torch.int64)}, "labels"),
    ],
)
def test_backward_frame_must_match_the_pending_features(tensors, why):
    frame = decode_frame(encode_frame("backward", tensors), max_bytes=LIMIT)
    with pytest.raises(FrameError, match=why):
        check_backward_frame(frame, features_shape=(2, 4))


def test_backward_frame_accepts_the_pending_shape():
    frame = decode_frame(encode_frame("backward", {"grad": torch.ones(2, 4)}), max_bytes=LIMIT)
    assert torch.equal(check_backward_frame(frame, features_shape=(2, 4)), torch.ones(2, 4))


class ScriptedSession:
    """Plays the trunk's part in memory (identity trunk) and records what was sent."""

    def __init__(self) -> None:
        self.bytes_up = self.bytes_down = 0
        self.sent: list[tuple[str, torch.Tensor]] = []

    def forward_features(self, activations):
        self.sent.append(("forward", activations))
        return activations.clone()

    def backward_features(self, grad):
        self.sent.append(("backward", grad))
        return grad.clone()


def test_the_loop_sends_activations_and_feature_gradients_only():
    head, tail = split(digits_like_model("cnn"), 2)  # the scripted trunk is the identity
    session = ScriptedSession()
    batches = fixed_batches(3, batch=8)
    report = train_ushaped(head, tail, lambda: batches, session, epochs=1, lr=0.1)
    assert report.steps == 3 and len(session.sent) == EXCHANGES_PER_BATCH * 3
    assert [k for k, _ in session.sent] == ["forward", "backward"] * 3
    assert all(t.is_floating_point() for _, t in session.sent)
    assert 0 <= report.accuracy <= 1 and report.loss > 0


def test_a_refused_exchange_aborts_the_round():
    class Refusing(ScriptedSession):
        def backward_features(self, grad):
            raise TrunkRejected("backward without a pending forward")

    head, tail = split(digits_like_model("cnn"), 2)
    with pytest.raises(TrunkRejected):
        train_ushaped(head, tail, lambda: fixed_batches(1), Refusing(), epochs=1, lr=0.1)


# --- task, grant and strategy ----------------------------------------------


def test_tail_cut_travels_in_the_task_and_defaults_to_zero():
    task = replace(TASK, tail_cut=3)
    assert SplitTask.from_config(ConfigRecord(task.to_config())).tail_cut == 3
    legacy = {k: v for k, v in TASK.to_config().items() if k != "tail-cut"}
    assert SplitTask.from_config(legacy).tail_cut == 0
    cfg = compose_config(["strategy=ushaped", "model.tail_cut=3"])
    assert cfg.strategy.name == "ushaped"
    assert make_task_template(cfg, "127.0.0.1:1").tail_cut == 3


def test_grants_are_plain_unless_a_tail_cut_is_given():
    tokens = TokenRegistry()
    plain = tokens.lookup(tokens.issue(client="a", cut=1, server_round=1, ttl_s=60))
    u = tokens.lookup(tokens.issue(client="a", cut=1, server_round=1, ttl_s=60, tail_cut=3))
    assert plain is not None and plain.tail_cut is None
    assert u is not None and u.tail_cut == 3


def test_revocation_tells_listeners_which_tokens_died():
    tokens = TokenRegistry()
    heard: list[list[str]] = []
    tokens.on_revoke(heard.append)
    old = tokens.issue(client="a", cut=1, server_round=1, ttl_s=60)
    tokens.issue(client="b", cut=1, server_round=2, ttl_s=60)
    tokens.revoke_round(1)
    assert heard == [[old]]


def build_ushaped(*overrides: str) -> tuple[UShapedSplit, TokenRegistry]:
    cfg = compose_config(["strategy=ushaped", *overrides])
    tokens = TokenRegistry()
    runtime = SimpleNamespace(cfg=cfg, model=digits_like_model("cnn"), tokens=tokens)
    common = {
        "task": make_task_template(cfg, "127.0.0.1:1"),
        "issue_token": None,
        "revoke_round": tokens.revoke_round,
    }
    return PROTOCOLS["ushaped"](runtime, common), tokens


def test_the_builder_resolves_the_tail_cut_and_issues_ushaped_grants():
    strategy, tokens = build_ushaped("model.cut=2")
    assert isinstance(strategy, UShapedSplit)
    assert strategy.train_message_type == "train.ushaped"
    assert strategy.task.tail_cut == 4  # 0 resolved: the last stage
    grant = tokens.lookup(strategy.issue_token("7", 2, 1))
    assert grant is not None and (grant.cut, grant.tail_cut) == (2, 4)


def test_the_builder_refuses_bad_cuts():
    with pytest.raises(ValueError, match="cut=3, tail_cut=2"):
        build_ushaped("model.cut=3", "model.tail_cut=2")


def test_initial_arrays_hold_head_and_tail():
    model = digits_like_model("cnn")
    strategy = UShapedSplit(
        task=replace(TASK, cut=1, tail_cut=3), issue_token=lambda *a: "t",
        revoke_round=lambda r: None,
    )
    arrays = strategy.initial_arrays(model)
    assert isinstance(arrays, ArrayRecord)
    assert record_to_state(arrays).keys() == ushaped_state(model, 1, 3).keys()
    with pytest.raises(ValueError, match="cut < tail_cut"):
        UShapedSplit(task=TASK, issue_token=lambda *a: "t", revoke_round=lambda r: None)


def test_emulated_ushaped_session_paces_both_exchanges():
    slow = DeviceProfile("slow", flops_per_s=1e9, memory_bytes=1 << 30, uplink_mbps=0.1,
                         downlink_mbps=0.1, rtt_s=0.01)
    inner = ScriptedSession()
    session = EmulatedUShapedSession(inner, slow, host_flops_per_s=1e9)
    started = time.perf_counter()
    features = session.forward_features(torch.ones(2, 4))
    grad = session.backward_features(torch.ones(2, 4))
    assert torch.equal(features, torch.ones(2, 4)) and torch.equal(grad, torch.ones(2, 4))
    assert [k for k, _ in inner.sent] == ["forward", "backward"]
    assert time.perf_counter() - started >= 2 * slow.rtt_s  # one round trip per exchange


def test_a_device_too_small_for_head_and_tail_declines_with_numbers():
    task = replace(TASK, cut=1, tail_cut=3, momentum=0.0)
    needed = check_ushaped_memory(task, None)
    tiny = DeviceProfile("tiny", flops_per_s=1e9, memory_bytes=needed - 1, uplink_mbps=1,
                         downlink_mbps=1, rtt_s=0)
    with pytest.raises(MemoryBudgetExceeded, match=r"\[memory\] U-shaped cuts 1/3 at batch 32"):
        check_ushaped_memory(task, tiny)
