"""U-shaped split learning: cuts, client state, the client step, the trunk's session.

The device keeps the head ``[0, cut)``, the tail ``[tail_cut, n)`` and the loss;
the trunk runs the stages between. Per batch: ``forward`` (activations, no labels)
-> features; ``backward`` (d loss / d features) -> gradient at the cut.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

import clients.device as device_module
from clients.device import MemoryBudgetExceeded, Pacer, plan_round, virtual_time
from clients.loop import evaluate_round, train_round
from clients.steps.split import SplitStep
from clients.steps.ushaped import UShapedStep
from protocols import check_config, compose_config, protocol_named
from protocols.ushaped import UShapedOptions
from server.app import initial_arrays
from server.sessions.ushaped import UShapedSession, ushaped_sessions
from server.trunk import Trunk
from splitlearn.calibration import client_train_memory_bytes
from splitlearn.config import (
    DataPlaneConfig,
    DeviceProfileConfig,
    DevicesConfig,
    PrivacyConfig,
    RunSpec,
    decode_spec,
    encode_spec,
    run_spec,
)
from splitlearn.dataplane import TokenRegistry, TrunkChannel, TrunkRejected
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import encode_tensor
from splitlearn.messages import record_to_state
from splitlearn.planning.clock import ClientMeasurement
from splitlearn.planning.devices import DeviceProfile
from splitlearn.privacy import ClientPrivacy
from splitlearn.stages import (
    load_bottom_state,
    resolve_tail_cut,
    split_u,
    stages_state,
    ushaped_state,
)
from strategies.splitfed import DataPlaneAccess, SplitFed
from tests.conftest import digits_like_model, fixed_batches
from tests.helpers import max_param_diff, send_raw, train_whole

LR = 0.1


def ushaped_spec(tail_cut: int = 0, *, lr: float = LR, **kw) -> RunSpec:
    """Plain SGD (what makes U-shaped training equal whole-model SGD)."""
    return RunSpec(strategy=UShapedOptions(lr=lr, momentum=0.0, tail_cut=tail_cut), **kw)


def serve(factory, model, tail_cut: int, **kw):
    return factory(model, protocol="ushaped", options=UShapedOptions(tail_cut=tail_cut), lr=LR,
                   **kw)


def head_acts(model, cut: int, batch: int = 4, seed: int = 0) -> Tensor:
    x = fixed_batches(1, batch=batch, seed=seed)[0][0]
    with torch.no_grad():
        for stage in copy.deepcopy(model).stages[:cut]:
            x = stage(x)
    return x


def trunk_state(server) -> dict[str, Tensor]:
    return copy.deepcopy(server.model.state_dict())


def unchanged(server, before: dict[str, Tensor]) -> bool:
    return all(torch.equal(v, server.model.state_dict()[k]) for k, v in before.items())


def refusal_of(reply: pb.Reply) -> str:
    assert reply.WhichOneof("kind") == "refusal", reply
    return pb.Refusal.Reason.Name(reply.refusal.reason)


def raw_forward(channel: TrunkChannel, **tensors: Tensor) -> pb.Reply:
    part = pb.Forward(**{k: encode_tensor(v).to_proto() for k, v in tensors.items()})
    return send_raw(channel, pb.Request(seq=channel.next_seq(), forward=part).SerializeToString())


def raw_backward(channel: TrunkChannel, grad: Tensor | None) -> pb.Reply:
    part = pb.Backward() if grad is None else pb.Backward(grad=encode_tensor(grad).to_proto())
    return send_raw(channel, pb.Request(seq=channel.next_seq(), backward=part).SerializeToString())


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


def test_the_step_trains_and_sends_back_head_and_tail_only():
    model = digits_like_model("cnn")
    step = UShapedStep(model, ushaped_spec(3), cut=1)
    assert step.tail_cut == 3 and step.exchanges_per_batch == 2
    trained = {id(p) for p in step.trained().parameters()}
    expected = {id(p) for i in (0, 3, 4) for p in model.stages[i].parameters()}
    assert trained == expected  # the trunk's stages are not the device's to train
    assert step.state().keys() == ushaped_state(model, 1, 3).keys()
    with pytest.raises(ValueError, match="cut=3, tail_cut=3"):
        UShapedStep(model, ushaped_spec(3), cut=3)


def test_the_memory_estimate_adds_the_tail_to_the_head():
    model = digits_like_model("cnn")
    batch = 32
    head = client_train_memory_bytes(model, 1, batch_size=batch)
    step = UShapedStep(model, ushaped_spec(0), cut=1)
    # Independent recomputation: the tail's saved activations per sample, and its
    # parameters, gradients and momentum (counted from the modules, not the cost table).
    tail_params = sum(p.numel() for p in model.stages[4].parameters())
    tail_saved = model.stage_costs()[4].train_memory_bytes_per_sample
    assert step.memory_bytes(batch) == head + tail_saved * batch + 3 * 4 * tail_params
    assert step.memory_bytes(batch) > SplitStep(model, ushaped_spec(0), cut=1).memory_bytes(batch)
    # A longer tail costs more.
    assert UShapedStep(model, ushaped_spec(2), cut=1).memory_bytes(batch) > step.memory_bytes(batch)


def device_spec(memory_bytes: int) -> RunSpec:
    tiny = DeviceProfileConfig(flops_per_s=1e9, memory_bytes=memory_bytes, uplink_mbps=1,
                               downlink_mbps=1, rtt_s=0.01)
    return ushaped_spec(3, devices=DevicesConfig(name="tiny", mix={"tiny": 1.0},
                                                 profiles={"tiny": tiny}))


def test_a_device_too_small_for_head_and_tail_declines_with_numbers():
    model = digits_like_model("cnn")
    needed = UShapedStep(model, ushaped_spec(3), cut=1).memory_bytes(32)
    head_only = SplitStep(model, ushaped_spec(3), cut=1).memory_bytes(32)
    # Room for the head alone, not for head and tail.
    plan = plan_round(device_spec(needed - 1), server_round=1, partition_id=0, num_partitions=2)
    assert plan.profile is not None and plan.profile.memory_bytes == needed - 1
    plan.check_memory(head_only, what="split at cut 1, batch 32")
    message = (f"ushaped at cut 1, batch 32 needs {needed / 2**20:.1f} MiB; tiny has "
               f"{(needed - 1) / 2**20:.1f} MiB")
    with pytest.raises(MemoryBudgetExceeded, match=message.replace(".", r"\.")) as declined:
        plan.check_memory(needed, what="ushaped at cut 1, batch 32")
    assert declined.value.kind == "memory"
    fits = plan_round(device_spec(needed), server_round=1, partition_id=0, num_partitions=2)
    fits.check_memory(needed, what="ushaped")


# --- the client step through the trunk: whole-model SGD, label-free frames ------------


def capture(channel: TrunkChannel) -> list[pb.Request]:
    """Record every request frame that leaves the device on ``channel``."""
    sent: list[pb.Request] = []
    send = channel.transport.send

    def recording(data: bytes) -> None:
        sent.append(pb.Request.FromString(data))
        send(data)

    channel.transport.send = recording  # type: ignore[method-assign]
    return sent


def assert_label_free(requests: list[pb.Request]) -> None:
    for request in requests:
        kind = request.WhichOneof("kind")
        part = getattr(request, kind)
        assert not (kind in ("forward", "evaluate") and part.HasField("labels")), kind
        for field, value in part.ListFields():
            assert value.dtype != pb.INT64, f"{kind}.{field.name} is int64"


@pytest.mark.parametrize(("name", "cut", "tail_cut"), [("cnn", 1, 3), ("resnet", 1, 3)])
def test_ushaped_training_equals_whole_model_sgd_through_a_real_trunk(
    trunk_server_factory, name, cut, tail_cut
):
    reference = digits_like_model(name)
    batches = fixed_batches(5, batch=8)
    whole = copy.deepcopy(reference)
    train_whole(whole, batches, LR)
    server = serve(trunk_server_factory, reference, tail_cut)
    # The trunk's segment really transforms (no identity trunk can pass this test).
    x = head_acts(reference, cut)
    with torch.no_grad():
        middle = nn.Sequential(*copy.deepcopy(reference).stages[cut:tail_cut]).eval()(x)
    assert middle.shape != x.shape

    client = copy.deepcopy(reference)
    step = UShapedStep(client, ushaped_spec(tail_cut), cut=cut)
    channel = server.local_channel(server.token(cut))
    sent = capture(channel)
    report = train_round(step, channel, ClientPrivacy(PrivacyConfig(), batches), epochs=1)

    assert report.steps == len(batches) == server.trunk.steps
    assert report.exchanges == 2 * len(batches)
    # The joined model: the device's head and tail, the trunk's stages between.
    joined = copy.deepcopy(server.model)
    for i in [*range(cut), *range(tail_cut, reference.num_stages)]:
        joined.stages[i] = client.stages[i]
    diff = max_param_diff(joined, whole)
    assert diff <= 1e-5, f"{name} cuts {cut}/{tail_cut}: max abs diff {diff}"
    assert max_param_diff(joined, reference) > 1e-3  # it did train
    # What left the device: forward (activations) and backward (feature gradients).
    assert [r.WhichOneof("kind") for r in sent] == ["forward", "backward"] * len(batches)
    assert_label_free(sent)
    assert server.handler.pending_sessions == 0

    # Evaluation: evaluate frames only, no labels, nothing updated.
    sent.clear()
    before = trunk_state(server)
    loss, accuracy, examples = evaluate_round(step, channel, batches[:2])
    assert examples == 16 and loss > 0 and 0 <= accuracy <= 1
    assert {r.WhichOneof("kind") for r in sent} == {"evaluate"}
    assert_label_free(sent)
    assert unchanged(server, before) and server.trunk.steps == len(batches)
    channel.close()


def test_the_trunk_refuses_frames_that_carry_labels(trunk_server_factory):
    model = digits_like_model("cnn")
    server = serve(trunk_server_factory, model, 3)
    channel = server.local_channel(server.token(1))
    acts, labels = head_acts(model, 1), torch.arange(4)
    before = trunk_state(server)
    for kind in ("forward", "evaluate"):
        part = {"activations": encode_tensor(acts).to_proto(),
                "labels": encode_tensor(labels).to_proto()}
        request = pb.Request(seq=channel.next_seq(), **{kind: getattr(pb, kind.title())(**part)})
        reply = send_raw(channel, request.SerializeToString())
        assert refusal_of(reply) == "BAD_TENSOR" and "labels" in reply.refusal.detail
    assert unchanged(server, before) and server.handler.pending_sessions == 0
    assert server.endpoint.refusals["in-process"] == 2
    # Backward has no field a label could ride in.
    assert set(pb.Backward.DESCRIPTOR.fields_by_name) == {"grad"}
    channel.close()


# --- the trunk's session: pending forwards and refusals ---------------------------


def test_backward_without_a_forward_is_refused(trunk_server_factory):
    model = digits_like_model("cnn")
    server = serve(trunk_server_factory, model, 3)
    channel = server.local_channel(server.token(1))
    with pytest.raises(TrunkRejected, match="^NO_PENDING_FORWARD: "):
        channel.backward(torch.ones(4, *model.cut_shape(3)))
    assert server.trunk.steps == 0
    channel.close()


FEATURES = (4, 128, 2, 2)  # cnn features at tail cut 3 for a batch of 4


@pytest.mark.parametrize(
    ("grad", "reason", "why"),
    [
        (None, "BAD_TENSOR", "no grad"),
        (torch.ones(4, 128, 2, 3), "BAD_TENSOR", "expected a float tensor of shape (4, 128, 2, 2)"),
        (torch.ones(FEATURES, dtype=torch.int64), "BAD_TENSOR", "float"),
        (torch.full(FEATURES, float("inf")), "NOT_FINITE", "NaN or infinite"),
        (torch.full(FEATURES, float("nan")), "NOT_FINITE", "NaN or infinite"),
        (torch.full(FEATURES, 3.0e38), "OUT_OF_RANGE", "above the bound"),
    ],
)
def test_a_bad_backward_is_refused_and_changes_nothing(trunk_server_factory, grad, reason, why):
    model = digits_like_model("cnn")
    server = serve(trunk_server_factory, model, 3)
    channel = server.local_channel(server.token(1))
    acts = head_acts(model, 1)
    features = channel.forward_features(acts)
    assert tuple(features.shape) == FEATURES
    before = trunk_state(server)
    reply = raw_backward(channel, grad)
    assert refusal_of(reply) == reason and why in reply.refusal.detail, reply.refusal.detail
    # Nothing changed: no step, same weights, and the pending forward is still there.
    assert unchanged(server, before) and server.trunk.steps == 0
    assert server.handler.pending_sessions == 1
    grad_at_cut = channel.backward(torch.ones(FEATURES))
    assert grad_at_cut.shape == acts.shape and server.trunk.steps == 1
    channel.close()


def test_a_second_forward_replaces_the_pending_one(trunk_server_factory):
    model = digits_like_model("cnn")
    server = serve(trunk_server_factory, model, 4)
    channel = server.local_channel(server.token(2))
    first, second = head_acts(model, 2, batch=4), head_acts(model, 2, batch=6, seed=1)
    channel.forward_features(first)
    reply = raw_forward(channel, activations=second)
    assert reply.WhichOneof("kind") == "features" and reply.features.replaced_pending
    assert server.handler.replaced == 1 and server.handler.pending_sessions == 1
    assert server.trunk.steps == 0  # the abandoned batch never stepped the trunk
    with pytest.raises(TrunkRejected, match=r"^BAD_TENSOR: .*\(6, 128\)"):  # the 4 are gone
        channel.backward(torch.ones(4, 128))
    # The backward of the second batch is the gradient through the trunk for *it*.
    grad_features = torch.randn(6, 128)
    ref = copy.deepcopy(model)
    leaf = second.clone().requires_grad_(True)
    nn.Sequential(*ref.stages[2:4])(leaf).backward(grad_features)
    assert torch.allclose(channel.backward(grad_features), leaf.grad, atol=1e-6)
    assert server.trunk.steps == 1 and server.trunk.samples == 6
    channel.close()


def test_pending_graphs_are_dropped_when_the_stream_ends_or_the_round_is_revoked(
    trunk_server_factory,
):
    model = digits_like_model("cnn")
    server = serve(trunk_server_factory, model, 4)
    acts = head_acts(model, 1)
    ushaped = server.handler

    ended = server.local_channel(server.token(1, client="ended"))
    ended.forward_features(acts)
    assert ushaped.pending_sessions == 1
    ended.close()  # the device never sends the backward
    assert ushaped.pending_sessions == 0

    revoked = server.local_channel(server.token(1, client="revoked", server_round=1))
    later = server.local_channel(server.token(1, client="later", server_round=2))
    revoked.forward_features(acts)
    later.forward_features(acts)
    server.tokens.revoke_round(1)  # the round ends while a graph is pending
    assert ushaped.pending_sessions == 1  # round 2's session keeps its graph
    with pytest.raises(TrunkRejected, match="CANCELLED|TOKEN_REJECTED"):
        revoked.backward(torch.ones(4, 128))
    later.backward(torch.ones(4, 128))
    assert server.trunk.steps == 1 and ushaped.pending_sessions == 0
    later.close()


def test_a_refused_exchange_aborts_the_round_and_leaves_the_trunk_consistent(
    trunk_server_factory,
):
    model = digits_like_model("cnn")
    server = serve(trunk_server_factory, model, 3)
    channel = server.local_channel(server.token(1, server_round=1))
    step = UShapedStep(copy.deepcopy(model), ushaped_spec(3), cut=1)

    def end_round_after_first(steps: int) -> None:
        server.tokens.revoke_round(1)

    with pytest.raises(TrunkRejected):
        train_round(step, channel, ClientPrivacy(PrivacyConfig(), fixed_batches(3, batch=8)),
                    epochs=1, on_step=end_round_after_first)
    assert server.trunk.steps == 1 and server.handler.pending_sessions == 0


def test_a_session_with_no_trunk_stage_left_is_refused(trunk_server_factory):
    model = digits_like_model("cnn")
    server = serve(trunk_server_factory, model, 0)  # tail cut: the last stage (4)
    assert server.handler.tail_cut == 4
    channel = server.local_channel(server.token(4))
    reply = raw_forward(channel, activations=head_acts(model, 4))
    assert refusal_of(reply) == "BAD_TENSOR" and "tail cut 4" in reply.refusal.detail
    channel.close()


# --- options, grants, strategy, registry ------------------------------------------


def test_tail_cut_travels_in_the_spec_and_defaults_to_zero():
    assert UShapedOptions().tail_cut == 0
    text = encode_spec(ushaped_spec(3))
    assert decode_spec(text, strategy=UShapedOptions).strategy.tail_cut == 3
    cfg = compose_config(["strategy=ushaped", "strategy.tail_cut=3"])
    assert cfg.strategy.name == "ushaped" and cfg.strategy.tail_cut == 3
    assert run_spec(cfg, host_flops_per_s=0.0).strategy.tail_cut == 3
    assert compose_config(["strategy=ushaped"]).strategy.tail_cut == 0


def test_the_trunk_side_resolves_the_tail_cut():
    model = digits_like_model("cnn")
    dataplane = DataPlaneConfig()
    for tail_cut, expected in [(0, 4), (3, 3)]:
        handler = ushaped_sessions(Trunk(copy.deepcopy(model), lr=LR),
                                   UShapedOptions(tail_cut=tail_cut), dataplane)
        assert isinstance(handler, UShapedSession) and handler.tail_cut == expected
    assert protocol_named("ushaped").trunk is ushaped_sessions


def test_revocation_tells_listeners_which_tokens_died():
    tokens = TokenRegistry()
    heard: list[list[str]] = []
    tokens.on_revoke(heard.append)
    old = tokens.issue(client="a", protocol="ushaped", cut=1, server_round=1, ttl_s=60)
    tokens.issue(client="b", protocol="ushaped", cut=1, server_round=2, ttl_s=60)
    tokens.revoke_round(1)
    assert heard == [[old]]


def test_the_strategy_grants_ushaped_sessions_at_the_clients_cut():
    tokens = TokenRegistry()
    spec = RunSpec(strategy=UShapedOptions(tail_cut=4))
    spec.model.cut = 2
    strategy = SplitFed(
        protocol="ushaped", spec=spec, trunk=SimpleNamespace(finish_round=lambda f: None),
        dataplane=DataPlaneAccess(tokens, "127.0.0.1:1", 60.0),
    )
    record = strategy.round_record(7, 1)
    assert record["cut"] == 2 and record["trunk_address"] == "127.0.0.1:1"
    grant = tokens.lookup(record["token"])
    assert grant is not None
    assert (grant.client, grant.protocol, grant.cut, grant.server_round) == ("7", "ushaped", 2, 1)


def test_the_preflight_refuses_bad_cut_pairs_naming_both(tmp_path):
    cfg = compose_config(["strategy=ushaped", "model.cut=3", "strategy.tail_cut=2"])
    cfg.run_dir = str(tmp_path)
    with pytest.raises(ValueError, match="cut=3, tail_cut=2"):
        check_config(cfg)
    cfg.strategy.tail_cut = 4
    check_config(cfg)  # the same config with a good pair passes


def test_initial_arrays_hold_head_and_tail():
    model = digits_like_model("cnn")
    spec = ushaped_spec(3)
    spec.model.cut = 1
    runtime = SimpleNamespace(protocol=protocol_named("ushaped"), spec=spec,
                              trunk=Trunk(copy.deepcopy(model), lr=LR), planning=None)
    state = record_to_state(initial_arrays(runtime))
    expected = ushaped_state(model, 1, 3)
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], v) for k, v in expected.items())


# --- the virtual clock and pacing charge two exchanges per batch ------------------------


def test_device_time_charges_a_round_trip_per_exchange(trunk_server_factory, monkeypatch):
    model = digits_like_model("cnn")
    server = serve(trunk_server_factory, model, 3)
    rtt = 100.0  # large, so that only the round trips matter
    slow = DeviceProfile("slow", flops_per_s=1e15, memory_bytes=1 << 30, uplink_mbps=1e6,
                         downlink_mbps=1e6, rtt_s=rtt)
    sleeps: list[float] = []
    monkeypatch.setattr(device_module, "time", SimpleNamespace(sleep=sleeps.append))
    pacer = Pacer(slow, host_flops_per_s=1e9)
    step = UShapedStep(copy.deepcopy(model), ushaped_spec(3), cut=1)
    channel = server.local_channel(server.token(1))
    report = train_round(step, channel, ClientPrivacy(PrivacyConfig(), fixed_batches(3, batch=4)),
                         epochs=1, pacer=pacer)
    channel.close()
    assert report.exchanges == 2 * 3
    vtime = virtual_time(report.measurement, profile=slow, host_flops_per_s=1e9)
    assert vtime.latency_s == pytest.approx(3 * 2 * rtt)
    # The pacer slept per batch: two round trips each, minus the (tiny) real wall time.
    assert len(sleeps) == 3 and all(1.5 * rtt < s <= 2 * rtt + 1 for s in sleeps)
    one = virtual_time(ClientMeasurement(0.0, 0, 0, UShapedStep.exchanges_per_batch),
                       profile=slow, host_flops_per_s=1e9)
    assert one.latency_s == 2 * rtt


# --- noise on the gradient the device returns ---------------------------------------


def ushaped_step(**privacy) -> UShapedStep:
    spec = RunSpec(strategy=UShapedOptions(tail_cut=3), privacy=PrivacyConfig(**privacy))
    return UShapedStep(digits_like_model(), spec, cut=1)


def test_without_gradient_noise_the_gradient_is_returned_as_computed():
    grad = torch.randn(8, 4, 2, 2)
    assert ushaped_step().returned_gradient(grad) is grad


def test_returned_gradient_rows_are_clipped_per_example_and_noised_at_sigma_c_over_b():
    batch, clip, sigma = 512, 0.5, 2.0
    step = ushaped_step(gradient_noise_multiplier=sigma, gradient_clip_norm=clip)
    # Per-example gradients (rows x batch) of norm 10, far above the clip: all clipped.
    grad = torch.randn(batch, 64)
    grad = grad / grad.norm(dim=1, keepdim=True) * 10 / batch
    sent = step.returned_gradient(grad)
    noise = sent - grad * (clip / 10)  # what is left after the clipped signal
    assert float(noise.std()) == pytest.approx(sigma * clip / batch, rel=0.02)
    # Noise is fresh per call and the direction of each clipped row survives on average.
    again = step.returned_gradient(grad)
    assert not torch.equal(sent, again)
    cosine = nn.functional.cosine_similarity((sent + again) / 2, grad, dim=1).mean()
    assert float(cosine) > 0


def test_gradient_noise_is_refused_outside_ushaped_and_bad_values_name_the_key():
    with pytest.raises(ValueError, match="strategy=splitfed_v2 returns none"):
        check_config(compose_config(["privacy.gradient_noise_multiplier=1", "logger=none"]))
    check_config(compose_config(["strategy=ushaped", "privacy.gradient_noise_multiplier=1",
                                 "logger=none"]))
    with pytest.raises(ValueError, match="privacy.gradient_clip_norm must be"):
        PrivacyConfig(gradient_clip_norm=0.0)
    with pytest.raises(ValueError, match="privacy.gradient_noise_multiplier must be"):
        PrivacyConfig(gradient_noise_multiplier=float("nan"))
