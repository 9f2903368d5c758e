"""The per-stage merge of a round: client copies and trunk copies, weighted by samples."""

from __future__ import annotations

import copy

import torch
from flwr.app import MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from server.sessions.split import SharedTrunk, SplitSession, TrunkPerClient, train_on_batch
from server.trunk import Trunk
from splitlearn.config import DataPlaneConfig
from splitlearn.merge import client_copy, merge_stages, stage_of, trunk_copy
from splitlearn.messages import record_to_state, state_to_record
from splitlearn.stages import bottom_state
from tests.conftest import digits_like_model, fixed_batches

LR = 0.1
LIMITS = DataPlaneConfig()


def acts_at(model, cut: int, seed: int, batch: int) -> tuple[Tensor, Tensor]:
    x, y = fixed_batches(1, batch=batch, seed=seed)[0]
    with torch.no_grad():
        for stage in model.stages[:cut]:
            x = stage(x)
    return x, y


def client_state(model, cut: int, seed: int) -> dict[str, Tensor]:
    """What a client would send back: the global stages below its cut, moved a little."""
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=generator)
            for k, v in bottom_state(model, cut).items()}


def reference_merge(copies: list[tuple[dict[str, Tensor], dict[int, int]]]) -> dict[str, Tensor]:
    """Slow and obvious: per key, sum weight x tensor over the copies holding its stage."""
    keys = sorted({k for state, samples in copies for k in state if samples.get(stage_of(k))})
    merged = {}
    for key in keys:
        holders = [(s[key], n[stage_of(key)]) for s, n in copies if n.get(stage_of(key))]
        total = sum(w for _, w in holders)
        merged[key] = sum(t.double() * (w / total) for t, w in holders).float()
    return merged


def test_equal_cuts_reduce_to_splitfed_v2_fedavg_on_clients_and_the_trunk_untouched():
    model = digits_like_model()
    cut = 2
    trunk = Trunk(copy.deepcopy(model), lr=LR)
    session = SplitSession(SharedTrunk(trunk), dataplane=LIMITS)
    for seed, batch in ((1, 8), (2, 24)):
        train_on_batch(trunk, cut, *acts_at(model, cut, seed, batch))
    trained = trunk.stage_state()
    updates = [(client_state(model, cut, 10), 8), (client_state(model, cut, 11), 24)]
    merged = session.merge_round(updates, upto=cut)
    # Flower's FedAvg of the client sides, as SplitFed v2 averaged them before.
    replies = [RecordDict({"arrays": state_to_record(s), "metrics": MetricRecord(
        {"num-examples": n})}) for s, n in updates]
    fedavg = record_to_state(aggregate_arrayrecords(replies, "num-examples"))
    assert merged.keys() == fedavg.keys()
    for key, value in fedavg.items():
        assert torch.equal(merged[key], value), key  # the same arithmetic, to the bit
    after = trunk.stage_state()
    for key, value in trained.items():
        if stage_of(key) >= cut:  # the trunk's stages: exactly as it trained them
            assert torch.equal(after[key], value), key
        else:  # the client stages, now the same on both sides
            assert torch.equal(after[key], merged[key]), key


def test_different_cuts_on_a_shared_trunk_merge_each_stage_over_its_copies():
    model = digits_like_model()
    trunk = Trunk(copy.deepcopy(model), lr=LR)
    session = SplitSession(SharedTrunk(trunk), dataplane=LIMITS)
    # Client a holds cut 1 (8 samples), b cut 3 (24): the trunk trains stage 1-2 for
    # a alone and stages 3+ for both.
    train_on_batch(trunk, 1, *acts_at(model, 1, 1, 8))
    train_on_batch(trunk, 3, *acts_at(model, 3, 2, 24))
    assert trunk.stage_samples == [0, 8, 8, 32, 32]
    a, b = client_state(model, 1, 10), client_state(model, 3, 11)
    trunk_state = trunk.stage_state()
    expected = reference_merge([
        (a, {0: 8}), (b, {0: 24, 1: 24, 2: 24}), (trunk_state, {1: 8, 2: 8, 3: 32, 4: 32}),
    ])
    merged = session.merge_round([(a, 8), (b, 24)], upto=3)
    assert merged.keys() == set(bottom_state(model, 3))  # the global arrays: stages 0-2
    for key, value in merged.items():
        assert torch.allclose(value, expected[key], atol=1e-7), key
    after = trunk.stage_state()
    for key, value in expected.items():  # the trunk took every merged stage
        assert torch.allclose(after[key], value, atol=1e-7), key
    assert trunk.stage_samples == [0] * 5  # the books start again next round


def test_a_trunk_copy_per_client_with_any_cuts_averages_every_stage_once_per_client():
    model = digits_like_model()
    pool = TrunkPerClient(Trunk(copy.deepcopy(model), lr=LR))
    session = SplitSession(pool, dataplane=LIMITS)
    batches = {"a": (1, 8), "b": (3, 24), "gone": (2, 8)}
    for client, (cut, batch) in batches.items():
        train_on_batch(pool.trunk_for(client), cut, *acts_at(model, cut, len(client), batch))
    copies = {c: pool.trunk_for(c).stage_state() for c in ("a", "b")}
    session.finish_round(["a", "b"])  # "gone" did not finish
    a, b = client_state(model, 1, 10), client_state(model, 3, 11)
    merged = session.merge_round([(a, 8), (b, 24)], upto=3)
    # Each client's two copies together hold every stage once, trained on its samples.
    whole = {c: {**copies[c], **s} for c, s in (("a", a), ("b", b))}
    for key in model.stages.state_dict():
        expected = whole["a"][key].double() * 0.25 + whole["b"][key].double() * 0.75
        assert torch.allclose(pool.trunk.stage_state()[key].double(), expected, atol=1e-6), key
    assert merged.keys() == set(bottom_state(model, 3))
    assert (pool.trunk.steps, pool.trunk.samples) == (2, 32)


def test_a_trunk_copy_per_client_with_any_cuts_is_flowers_fedavg_to_the_bit():
    """Three clients at cuts 1, 3 and 2: each stage adds its copies in client order,
    whichever side holds them, as Flower's FedAvg adds up the whole models."""
    model = digits_like_model()
    pool = TrunkPerClient(Trunk(copy.deepcopy(model), lr=LR))
    session = SplitSession(pool, dataplane=LIMITS)
    clients = {"a": (1, 8), "b": (3, 24), "c": (2, 16)}
    sides = {}
    for seed, (client, (cut, batch)) in enumerate(clients.items()):
        train_on_batch(pool.trunk_for(client), cut, *acts_at(model, cut, seed, batch))
        sides[client] = client_state(model, cut, 10 + seed)
    whole = {c: {**pool.trunk_for(c).stage_state(), **sides[c]} for c in clients}
    session.finish_round(list(clients))
    session.merge_round([(sides[c], n) for c, (_, n) in clients.items()], upto=3)
    replies = [RecordDict({"arrays": state_to_record(whole[c]), "metrics": MetricRecord(
        {"num-examples": n})}) for c, (_, n) in clients.items()]
    fedavg = record_to_state(aggregate_arrayrecords(replies, "num-examples"))
    merged = pool.trunk.stage_state()
    for key, value in fedavg.items():
        assert torch.equal(merged[key], value), key


def test_merge_keeps_dtypes_and_a_lone_copy_bit_for_bit():
    state = {"0.weight": torch.randn(3), "0.num_batches_tracked": torch.tensor(7)}
    other = {"0.weight": torch.randn(3), "0.num_batches_tracked": torch.tensor(10)}
    merged = merge_stages([client_copy(state, 1), client_copy(other, 2)])
    assert merged["0.num_batches_tracked"].dtype == torch.int64
    assert int(merged["0.num_batches_tracked"]) == 9  # (7 + 2 x 10) / 3, rounded
    alone = merge_stages([client_copy(state, 5), trunk_copy(other, [0])])
    assert torch.equal(alone["0.weight"], state["0.weight"])


def test_ushaped_clients_at_different_cuts_merge_heads_tails_and_the_middle_per_stage():
    """U-shaped: the trunk books only the stages below the tail; tails are averaged over the
    clients alone, every other stage over every copy that trained it; the clients get back
    heads below the deepest cut and the tail."""
    from server.sessions.ushaped import UShapedSession
    from splitlearn.stages import ushaped_state

    model = digits_like_model()
    tail_cut = 4
    trunk = Trunk(copy.deepcopy(model), lr=LR)
    session = UShapedSession(SharedTrunk(trunk), tail_cut=tail_cut, dataplane=LIMITS)
    for cut, seed, batch in ((1, 1, 8), (3, 2, 24)):  # what two U-shaped steps book
        acts = acts_at(model, cut, seed, batch)[0].requires_grad_(True)
        with trunk.step(samples=batch, from_stage=cut, to_stage=tail_cut) as backward:
            features = trunk.run(acts, cut, tail_cut)
            backward(features, torch.ones_like(features))
    assert trunk.stage_samples == [0, 8, 8, 32, 0]  # the tail is the devices'
    moved = torch.Generator().manual_seed(0)
    a, b = ({k: v + 0.01 * torch.randn(v.shape, generator=moved)
             for k, v in ushaped_state(model, cut, tail_cut).items()} for cut in (1, 3))
    trunk_state = trunk.stage_state()
    expected = reference_merge([
        (a, {0: 8, 4: 8}), (b, {0: 24, 1: 24, 2: 24, 4: 24}),
        (trunk_state, {1: 8, 2: 8, 3: 32}),
    ])
    merged = session.merge_round([(a, 8), (b, 24)], upto=3)
    assert merged.keys() == set(ushaped_state(model, 3, tail_cut))  # heads to 3, and the tail
    for key, value in merged.items():
        assert torch.allclose(value, expected[key], atol=1e-7), key
    after = trunk.stage_state()
    for key, value in expected.items():
        assert torch.allclose(after[key], value, atol=1e-7), key


def test_the_trunk_keeps_momentum_only_for_the_stages_it_trained_this_round():
    """A stage that moved to the devices loses its trunk momentum: when it comes back it
    starts afresh, as on a device, instead of replaying a direction from before the merge."""
    model = digits_like_model()
    trunk = Trunk(copy.deepcopy(model), lr=LR, momentum=0.9)
    session = SplitSession(SharedTrunk(trunk), dataplane=LIMITS)
    params = {i: list(trunk.model.stages[i].parameters()) for i in range(model.num_stages)}

    def has_momentum(stage: int) -> bool:
        return all("momentum_buffer" in trunk.optimizer.state.get(p, {}) for p in params[stage])

    train_on_batch(trunk, 1, *acts_at(model, 1, 1, 8))  # round 1: a client at cut 1
    session.merge_round([(client_state(model, 1, 10), 8)], upto=3)
    assert has_momentum(1) and has_momentum(3)
    train_on_batch(trunk, 3, *acts_at(model, 3, 2, 8))  # round 2: it moved to cut 3
    session.merge_round([(client_state(model, 3, 11), 8)], upto=3)
    assert not any(trunk.optimizer.state.get(p) for i in (1, 2) for p in params[i])
    assert has_momentum(3) and has_momentum(4)  # still trained here: kept
    # Back at cut 1: stage 1's first step is plain SGD (no stale momentum), as on a device.
    before = [p.detach().clone() for p in params[1]]
    acts, labels = acts_at(model, 1, 3, 8)
    expected = copy.deepcopy(trunk.model)
    loss = nn.functional.cross_entropy(nn.Sequential(*expected.stages[1:])(acts), labels)
    grads = torch.autograd.grad(loss, list(expected.stages[1].parameters()))
    train_on_batch(trunk, 1, acts, labels)
    for p, b, g in zip(params[1], before, grads, strict=True):
        assert torch.allclose(p.detach(), b - LR * g, atol=1e-6)


# --- any cuts, any samples, against the slow reference ------------------------------

#: Per client: its cut and the samples of its one batch this round.
CLIENTS = st.lists(st.tuples(st.sampled_from([1, 2, 3, 4]), st.integers(1, 32)),
                   min_size=1, max_size=4)


@settings(max_examples=30, deadline=None)
@given(clients=CLIENTS)
def test_any_cuts_on_a_shared_trunk_merge_as_the_slow_reference(clients):
    """Clients at any cuts with any samples: each stage is the samples-weighted mean of the
    client copies holding it and of the trunk's copy, trained on the samples of every client
    whose cut is at or below it; clients and trunk then hold the merged stages."""
    model = digits_like_model()
    trunk = Trunk(copy.deepcopy(model), lr=LR)
    session = SplitSession(SharedTrunk(trunk), dataplane=LIMITS)
    for seed, (cut, batch) in enumerate(clients):
        train_on_batch(trunk, cut, *acts_at(model, cut, seed, batch))
    stages = range(model.num_stages)
    assert trunk.stage_samples == [sum(n for c, n in clients if c <= s) for s in stages]
    sides = [client_state(model, cut, 10 + i) for i, (cut, _) in enumerate(clients)]
    expected = reference_merge([
        *((side, dict.fromkeys(range(cut), n))
          for side, (cut, n) in zip(sides, clients, strict=True)),
        (trunk.stage_state(), {s: n for s, n in enumerate(trunk.stage_samples) if n}),
    ])
    upto = max(cut for cut, _ in clients)
    updates = [(side, n) for side, (_, n) in zip(sides, clients, strict=True)]
    merged = session.merge_round(updates, upto=upto)
    assert merged.keys() == set(bottom_state(model, upto))
    after = trunk.stage_state()
    assert after.keys() == expected.keys()  # every stage was trained by some copy
    for key, value in expected.items():
        assert torch.allclose(after[key], value, atol=1e-6), key
        if key in merged:
            assert torch.equal(merged[key], after[key]), key
    assert trunk.stage_samples == [0] * model.num_stages


@settings(max_examples=30, deadline=None)
@given(clients=CLIENTS, gone=st.lists(st.booleans(), min_size=4, max_size=4))
def test_any_cuts_with_a_trunk_copy_per_client_are_fedavg_of_the_finished_whole_models(
        clients, gone):
    """SplitFed v1 at any cuts: each finished client's two copies make one whole model, and
    the merge is FedAvg of those by samples; a client that did not finish counts nowhere."""
    finished = [i for i in range(len(clients)) if not gone[i]] or [0]
    model = digits_like_model()
    pool = TrunkPerClient(Trunk(copy.deepcopy(model), lr=LR))
    session = SplitSession(pool, dataplane=LIMITS)
    sides, whole = {}, {}
    for i, (cut, batch) in enumerate(clients):
        train_on_batch(pool.trunk_for(str(i)), cut, *acts_at(model, cut, i, batch))
        sides[i] = client_state(model, cut, 10 + i)
        whole[i] = {**pool.trunk_for(str(i)).stage_state(), **sides[i]}
    session.finish_round([str(i) for i in finished])
    upto = max(clients[i][0] for i in finished)
    merged = session.merge_round([(sides[i], clients[i][1]) for i in finished], upto=upto)
    total = sum(clients[i][1] for i in finished)
    after = pool.trunk.stage_state()
    for key in model.stages.state_dict():
        mean = sum(whole[i][key].double() * (clients[i][1] / total) for i in finished)
        assert torch.allclose(after[key].double(), mean, atol=1e-6), key
    assert merged.keys() == set(bottom_state(model, upto))
    assert (pool.trunk.steps, pool.trunk.samples) == (
        len(finished), sum(clients[i][1] for i in finished))
