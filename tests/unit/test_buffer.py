"""The replay buffer (moe_rl/rollout/buffer.py) against what it promises: draws follow the documented priority
formulas (chi-square over 10 000 draws, the formulas recomputed here from the raw rollout), fresh_fraction
brings in never-trained groups, eviction by age and capacity, a bit-exact checkpoint (draws included), and
that a replayed group reaches the actor as it was sampled: the same tokens, mu, versions and routes (the
log-probs of a real Megatron actor replaying them equal the original batch's), each group's samples
consecutive for the advantages, and no importance weight added anywhere."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest
import torch

from moe_rl.common.batch import PaddedBatch
from moe_rl.data.prompts import Prompt
from moe_rl.objectives import grpo_advantages
from moe_rl.rollout.buffer import ReplayBuffer, assemble
from moe_rl.rollout.config import PRIORITIES
from moe_rl.rollout.source import Rollout

PAD = 3  # a pad id other than 0, so padding written by the buffer is told apart from zeros


def _seed() -> int:
    return int(torch.randint(0, 2**31, ()).item())


def _rollout(
    groups: int,
    n: int,
    gen: torch.Generator,
    *,
    versions: list[int] | None = None,
    prompt_ids: list[int] | None = None,
    pass_rates: list[float] | None = None,
    vocab: int = 50,
    layers: int = 2,
    topk: int = 2,
    experts: int = 8,
) -> Rollout:
    """`groups` x `n` samples as the engine source builds them: right-padded, a few prompt tokens then the
    response (loss_mask 1), mu < 0 on the response, routes of K distinct ids on real positions and the filler
    (0..K-1) on padding. Group g: prompt `toy:{prompt_ids[g]}`, oldest sample version `versions[g]`."""
    b = groups * n
    versions = versions if versions is not None else [0] * groups
    prompt_ids = prompt_ids if prompt_ids is not None else list(range(groups))
    prompt_len = torch.randint(2, 5, (b,), generator=gen)
    response_len = torch.randint(1, 9, (b,), generator=gen)
    total = prompt_len + response_len
    t = int(total.max()) + int(torch.randint(0, 4, (), generator=gen))  # sometimes all-padding columns
    pos = torch.arange(t)[None]
    real = pos < total[:, None]
    response = real & (pos >= prompt_len[:, None])
    ids = torch.where(real, torch.randint(0, vocab, (b, t), generator=gen), PAD)
    logprobs = torch.where(response, -4 * torch.rand(b, t, generator=gen) - 1e-3, 0.0)
    routes = torch.rand(b, t, layers, experts, generator=gen).argsort(-1)[..., :topk].to(torch.uint8)
    routes[~real] = torch.arange(topk, dtype=torch.uint8)
    version = torch.empty(b, dtype=torch.long)
    for g, v in enumerate(versions):  # later samples of a group may come from newer versions; one is the oldest
        rows = version[g * n : (g + 1) * n]
        rows.copy_(v + torch.randint(0, 3, (n,), generator=gen))
        rows[int(torch.randint(0, n, (), generator=gen))] = v
    if pass_rates is None:
        rewards = torch.rand(b, generator=gen)
    else:
        rewards = (torch.rand(b, generator=gen) < torch.tensor(pass_rates).repeat_interleave(n)).float()
    return Rollout(
        PaddedBatch(ids, real.long(), response.float(), logprobs, routes),
        policy_version=version,
        response_lengths=response_len,
        prompts=[Prompt(text=f"prompt {j}", source=f"toy:{j}") for j in range(max(prompt_ids) + 1)],
        prompt_index=[prompt_ids[g] for g in range(groups) for _ in range(n)],
        rewards=rewards,
        truncated=torch.rand(b, generator=gen) < 0.3,
    )


def _rows(group, n: int) -> slice:
    """The rows of a group in a rollout built with the default prompt_ids (group g has prompt toy:g)."""
    g = int(group.prompt.split(":")[1])
    return slice(g * n, (g + 1) * n)


def _filler(layers: int, topk: int) -> torch.Tensor:
    return torch.arange(topk, dtype=torch.uint8).expand(layers, topk).contiguous()


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(X >= statistic), X ~ chi2(len - 1): the regularised upper incomplete gamma Q(df / 2, stat / 2)."""
    expected = probs.double() / probs.sum() * counts.sum()
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(counts) - 1) / 2, dtype=torch.float64), stat / 2))


# ---- 1. draws follow the priority distribution ----------------------------------------------------------------

G, N, VERSION, DRAWS = 8, 4, 10, 10_000


@pytest.mark.parametrize("priority", PRIORITIES)
def test_draw_frequencies_follow_the_priority_formulas(priority):
    # a fixed seed: with a fresh one each of the five cases would fail 1% of runs by chance (p > 0.01 is a 1%
    # test); the formulas are still recomputed independently and a biased draw still fails
    seed = 1234 + PRIORITIES.index(priority)
    gen = torch.Generator().manual_seed(seed)
    alpha, eps = 1.5, 1e-3
    perm = torch.randperm(G, generator=gen)
    versions = (perm + VERSION - G + 1).tolist()  # ages 0..7
    prompt_ids = [0, 1, 2, 3, 4, 5, 0, 1]  # two prompts have two groups: their pass rates pool both
    pass_rates = torch.linspace(0.05, 0.95, G)[torch.randperm(G, generator=gen)].tolist()
    rollout = _rollout(G, N, gen, versions=versions, prompt_ids=prompt_ids, pass_rates=pass_rates)
    scale = torch.linspace(0.05, 2.0, G)[torch.randperm(G, generator=gen)].repeat_interleave(N)
    advantages = torch.randn(G * N, generator=gen) * scale
    buffer = ReplayBuffer(64, 100, priority, alpha=alpha, eps=eps, fresh_fraction=0.0, seed=seed)
    buffer.add(rollout, advantages, N, step=0)
    trained = torch.tensor([0, 1, 2, 3, 0, 2])[torch.randperm(6, generator=gen)]
    base = {f"toy:{j}": int(c) for j, c in enumerate(trained)}
    buffer.prompt_trained = dict(base)

    # the documented formulas, from the rollout itself
    rows = torch.arange(G * N).reshape(G, N)
    age = (VERSION - rollout.policy_version[rows].min(1).values).double()
    recency = (1 + age) ** -alpha
    advantage = advantages[rows].double().abs().mean(1) ** alpha + eps
    prompt_of = torch.tensor(prompt_ids)
    rate = torch.stack([rollout.rewards[rows][prompt_of == p].double().mean() for p in prompt_ids])
    rarity = (1 / (1 + trained[prompt_of].double()) + (rate - 0.5).abs()) ** alpha + eps
    want = {
        "uniform": torch.ones(G, dtype=torch.float64),
        "recency": recency,
        "advantage": advantage,
        "rarity": rarity,
        "mixed": sum(p / p.sum() for p in (recency, advantage, rarity)) / 3,
    }[priority]
    got = buffer.priorities(VERSION)
    assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=1e-6, atol=0), (seed, got, want)
    if priority != "uniform":  # the distribution is far from uniform: the chi-square below can tell them apart
        assert float(want.max() / want.min()) > 1.5, (seed, want)

    index = {id(g): i for i, g in enumerate(buffer.groups)}
    counts = torch.zeros(G)
    for _ in range(DRAWS):
        (group,) = buffer.sample(1, VERSION)
        counts[index[id(group)]] += 1
        if priority in ("rarity", "mixed"):
            # sample() counts the draw into its prompt's trained count (as it should: checked below), which
            # lowers that prompt's rarity for the next draw; restoring the counts keeps every draw on the one
            # distribution `want`, so the 10 000 draws are i.i.d. and the chi-square applies.
            assert buffer.prompt_trained[group.prompt] == base[group.prompt] + 1 and group.trained == 1
            buffer.prompt_trained = dict(base)
            group.trained = 0
    p = _chi2_pvalue(counts, want)
    assert p > 0.01, (seed, p, counts.tolist(), (want / want.sum() * DRAWS).tolist())
    if priority != "uniform":
        assert _chi2_pvalue(counts, torch.ones(G)) < 1e-6, (seed, counts.tolist())  # not uniform draws
    if priority in ("uniform", "recency", "advantage"):  # trained counts do not move these priorities
        assert sum(g.trained for g in buffer.groups) == DRAWS
        assert sum(buffer.prompt_trained.values()) == sum(base.values()) + DRAWS
        assert torch.allclose(buffer.priorities(VERSION), want, rtol=1e-6, atol=0)
    if priority == "rarity":  # one more training lowers that prompt's rarity term 1 / (1 + trained)
        (group,) = buffer.sample(1, VERSION)
        j = int(group.prompt.split(":")[1])
        before = (1 / (1 + base[group.prompt]) + abs(float(rate[prompt_ids.index(j)]) - 0.5)) ** alpha + eps
        after = (1 / (2 + base[group.prompt]) + abs(float(rate[prompt_ids.index(j)]) - 0.5)) ** alpha + eps
        now = buffer.priorities(VERSION)[index[id(group)]]
        assert float(now) == pytest.approx(after, rel=1e-6) and after < before


# ---- 2. fresh_fraction ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [3, 4])
def test_fresh_fraction_brings_in_never_trained_groups(k):
    """fresh_fraction=0.5: ceil(k / 2) = 2 never-trained groups per draw while there are that many, all there
    are after that. The fresh groups are old and alpha is large, so by recency alone they would (almost) never
    be drawn: the control buffer with fresh_fraction=0 draws none."""
    seed = _seed()
    need = math.ceil(0.5 * k)
    buffers = []
    for fraction in (0.5, 0.0):
        gen = torch.Generator().manual_seed(seed)
        buffer = ReplayBuffer(64, 100, "recency", alpha=8.0, fresh_fraction=fraction, seed=seed)
        seen = _rollout(6, 2, gen, versions=[20] * 6, prompt_ids=list(range(6)))
        for group in buffer.add(seen, torch.randn(12, generator=gen), 2, step=0):
            group.trained = 1
        buffer.add(_rollout(5, 2, gen, versions=[0, 1, 2, 3, 4], prompt_ids=list(range(6, 11))), torch.randn(10), 2, 1)
        buffers.append(buffer)
    buffer, control = buffers
    assert not any(g.trained == 0 for g in control.sample(k, 22))

    fresh_counts = []
    for _ in range(5):
        fresh_before = sum(g.trained == 0 for g in buffer.groups)
        chosen = buffer.sample(k, 22)
        assert len({id(g) for g in chosen}) == k  # without replacement
        fresh = sum(g.trained == 1 and int(g.prompt.split(":")[1]) >= 6 for g in chosen)  # never trained before
        assert fresh >= min(need, fresh_before), (seed, k, fresh, fresh_before)
        fresh_counts.append((fresh_before, fresh))
    assert fresh_counts[0][0] == 5 and fresh_counts[-1][0] == 0, fresh_counts  # ran through every case
    assert all(g.trained > 0 for g in buffer.groups)


# ---- 3. eviction ---------------------------------------------------------------------------------------------


def test_eviction_by_age_then_capacity_oldest_first():
    gen = torch.Generator().manual_seed(_seed())
    buffer = ReplayBuffer(capacity=4, max_age=3)
    # group i inserted at step i; its version is its oldest sample's
    versions = [10, 6, 7, 8, 9, 7, 10, 8]
    for i, v in enumerate(versions):
        rollout = _rollout(1, 3, gen, versions=[v], prompt_ids=[i])
        if i == 1:  # mostly version 9, one sample of version 6: the group is 4 versions old
            rollout.policy_version = torch.tensor([9, 6, 9])
        buffer.add(rollout, torch.randn(3, generator=gen), 3, step=i)
    assert [g.version for g in buffer.groups] == versions

    def kept():
        return sorted(int(g.prompt.split(":")[1]) for g in buffer.groups)

    # at version 10 (max_age 3): group 1 (version 6) is too old, version 7 is exactly max_age old and stays; then 7
    # groups for 4 places: the oldest versions go, within a version the earlier inserted (2, 5 at 7; 3 at 8)
    assert buffer.evict(10) == 4
    assert kept() == [0, 4, 6, 7]
    assert buffer.evict(10) == 0 and kept() == [0, 4, 6, 7]
    assert buffer.evict(12) == 1 and kept() == [0, 4, 6]  # group 7 (version 8) is now 4 versions old

    roomy = ReplayBuffer(capacity=100, max_age=2)  # age alone
    for i, v in enumerate([5, 2, 3, 1]):
        roomy.add(_rollout(1, 2, gen, versions=[v], prompt_ids=[i]), torch.randn(2), 2, step=i)
    assert roomy.evict(5) == 2 and [g.version for g in roomy.groups] == [5, 3]  # insertion order kept

    full = ReplayBuffer(capacity=2, max_age=100)  # capacity alone: the oldest first, not the first inserted
    for i, v in enumerate([9, 3, 7, 5]):
        full.add(_rollout(1, 2, gen, versions=[v], prompt_ids=[i]), torch.randn(2), 2, step=i)
    assert full.evict(9) == 2 and sorted(g.version for g in full.groups) == [7, 9]


# ---- 4. checkpoint -------------------------------------------------------------------------------------------


def test_checkpoint_round_trip_is_bit_exact_and_draws_the_same(tmp_path):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    settings = dict(capacity=32, max_age=50, priority="mixed", alpha=1.3, eps=1e-3, fresh_fraction=0.5)
    a = ReplayBuffer(**settings, seed=seed)
    for step, groups in enumerate((4, 5)):
        rollout = _rollout(groups, 3, gen, versions=torch.randint(0, 5, (groups,), generator=gen).tolist())
        rollout.prompts = [Prompt(text=p.text, source=f"{p.source}@{step}") for p in rollout.prompts]
        a.add(rollout, grpo_advantages(rollout.rewards, 3), 3, step=step)
    for _ in range(3):
        a.sample(2, 5)
    assert any(g.trained for g in a.groups) and a.prompt_trained
    path = tmp_path / "buffer" / "rank_00000.safetensors"
    a.save(path)

    b = ReplayBuffer(**settings, seed=seed + 1)
    assert not torch.equal(a.generator.get_state(), b.generator.get_state())
    b.load(path)
    assert torch.equal(a.generator.get_state(), b.generator.get_state())
    assert len(a.groups) == len(b.groups) == 9
    for ga, gb in zip(a.groups, b.groups, strict=True):
        assert ga.tensors.keys() == gb.tensors.keys()
        for key, value in ga.tensors.items():
            assert value.dtype == gb.tensors[key].dtype and torch.equal(value, gb.tensors[key]), key
        assert (ga.prompt, ga.inserted, ga.trained) == (gb.prompt, gb.inserted, gb.trained)
    assert a.groups[0].tensors["routes"].dtype == torch.uint8 and a.groups[0].tensors["truncated"].dtype == torch.bool
    assert a.prompt_trained == b.prompt_trained and a.prompt_rewards == b.prompt_rewards
    assert torch.equal(a.priorities(6), b.priorities(6))

    def position(buffer, chosen):
        return [next(i for i, g in enumerate(buffer.groups) if g is c) for c in chosen]

    draws = [(position(a, a.sample(3, 6)), position(b, b.sample(3, 6))) for _ in range(20)]
    assert all(x == y for x, y in draws), (seed, draws)
    assert len({tuple(x) for x, _ in draws}) > 1  # the draws do vary


# ---- 5. routes of a replayed sample ------------------------------------------------------------------------------


def test_assembled_groups_carry_the_sampled_tokens_mu_and_routes():
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    n, layers, topk = 4, 3, 2
    rollout = _rollout(3, n, gen, versions=[2, 0, 1], layers=layers, topk=topk, experts=16)
    buffer = ReplayBuffer(16, 100, seed=seed)
    buffer.add(rollout, grpo_advantages(rollout.rewards, n), n, step=2)
    chosen = buffer.sample(3, 3)
    t = rollout.padded.input_ids.shape[1]
    length = t + 5
    filler = _filler(layers, topk)
    out = assemble(chosen, PAD, length, filler).padded
    orig = rollout.padded
    assert out.input_ids.shape == (3 * n, length) and out.routes.shape == (3 * n, length, layers, topk)
    for key in ("input_ids", "attention_mask", "loss_mask", "rollout_logprobs", "routes"):
        assert getattr(out, key).dtype == getattr(orig, key).dtype, key
    out_real = out.attention_mask.bool()
    for block, group in enumerate(chosen):
        rows, here = _rows(group, n), slice(block * n, (block + 1) * n)
        real = orig.attention_mask[rows].bool()
        assert torch.equal(out_real[here, :t], real) and not out_real[here, t:].any()
        for key in ("input_ids", "loss_mask", "rollout_logprobs", "routes"):
            assert torch.equal(getattr(out, key)[here, :t][real], getattr(orig, key)[rows][real]), (seed, key)
    assert (out.routes[~out_real] == filler).all()
    assert (out.input_ids[~out_real] == PAD).all()
    assert not out.loss_mask[~out_real].any() and not out.rollout_logprobs[~out_real].any()

    # on a tensor/context-parallel peer the routes are held by another rank: zero-width in, zero-width out
    peer = replace(rollout, padded=replace(rollout.padded, routes=rollout.padded.routes[:, :0]))
    peer_buffer = ReplayBuffer(16, 100, seed=seed)
    peer_buffer.add(peer, grpo_advantages(peer.rewards, n), n, step=2)
    peer_out = assemble(peer_buffer.sample(3, 3), PAD, length, filler).padded
    assert peer_out.routes.shape == (3 * n, 0, layers, topk) and torch.equal(peer_out.input_ids, out.input_ids)


def test_assembled_multi_turn_groups_keep_the_turn_of_each_token():
    """A multi-turn rollout's turn_index (the turn that sampled each token, -1 on observations and padding) stays
    with its samples through the buffer, as the tokens and mu do (the buffer once dropped it)."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    n = 3
    rollout = _rollout(4, n, gen)
    real = rollout.padded.loss_mask.bool()
    rollout.turn_index = torch.where(real, torch.randint(0, 3, real.shape, generator=gen), -1)
    buffer = ReplayBuffer(16, 100, seed=seed)
    buffer.add(rollout, grpo_advantages(rollout.rewards, n), n, step=1)
    chosen = buffer.sample(4, 2)
    t = rollout.padded.input_ids.shape[1]
    out = assemble(chosen, PAD, t + 2, _filler(2, 2))
    assert out.turn_index.shape == (4 * n, t + 2) and (out.turn_index[:, t:] == -1).all()
    for block, group in enumerate(chosen):
        rows, here = _rows(group, n), slice(block * n, (block + 1) * n)
        assert torch.equal(out.turn_index[here, :t], rollout.turn_index[rows]), seed


def test_replayed_groups_give_the_actor_the_original_logprobs(tiny_models, world1):
    """The actor's log-probs with the stored routes replayed are the original batch's on every response token
    (the groups come back in another order, padded longer) and every token went to the replayed experts.
    The routes are random, not the model's own: live routing gives other log-probs, so they do matter."""
    from moe_rl.actor.actor import Actor
    from moe_rl.config import TrainConfig

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    cfg = TrainConfig()
    actor = Actor(cfg.actor, cfg.model, cfg.parallel, tiny_models["qwen3_moe"], record_routes=True)
    lay = actor.layout
    layers, n = len(lay.moe_layers), 3
    rollout = _rollout(
        2, n, gen, vocab=actor.hf_config.vocab_size, layers=layers, topk=lay.topk, experts=lay.num_experts
    )
    assert lay.num_experts <= 256 and int(rollout.padded.routes.max()) < lay.num_experts
    buffer = ReplayBuffer(8, 100, seed=seed)
    buffer.add(rollout, grpo_advantages(rollout.rewards, n), n, step=0)
    chosen = buffer.sample(2, 0)
    chosen = chosen[::-1] if chosen[0].prompt == "toy:0" else chosen  # the second group first
    t = rollout.padded.input_ids.shape[1]
    out = assemble(chosen, PAD, t + 3, _filler(layers, lay.topk)).padded

    def logprobs(padded, routes):
        replay = actor.replay if routes is not None else None
        return actor._logprobs(actor.chunks, replay, padded, with_entropy=False, routes=routes)["logprobs"]

    actor.replay.dispatch_check(reset=True)
    original = logprobs(rollout.padded, rollout.padded.routes)
    replayed = logprobs(out, out.routes)
    checked, mismatched = actor.replay.dispatch_check(reset=True)
    assert checked > 0 and mismatched == 0, (checked, mismatched)
    live = logprobs(out, None)
    for block, group in enumerate(chosen):
        rows, here = _rows(group, n), slice(block * n, (block + 1) * n)
        mask = rollout.padded.loss_mask[rows].bool()
        assert torch.equal(out.loss_mask[here, :t].bool(), mask)
        assert torch.equal(replayed[here, :t][mask], original[rows][mask]), (seed, group.prompt)
    assert not torch.allclose(live[out.loss_mask.bool()], replayed[out.loss_mask.bool()], atol=1e-4)


# ---- 6. group contiguity ---------------------------------------------------------------------------------------


def test_assembled_groups_stay_contiguous_for_the_advantages():
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    n = 4
    first = _rollout(3, n, gen, versions=[0, 0, 0], prompt_ids=[0, 1, 2])
    second = _rollout(3, n, gen, versions=[1, 1, 1], prompt_ids=[0, 1, 2])
    second.prompts = [Prompt(text=p.text, source=f"toy:{j + 3}") for j, p in enumerate(second.prompts)]
    buffer = ReplayBuffer(16, 100, seed=seed)
    stored = {}
    for step, rollout in enumerate((first, second)):
        advantages = grpo_advantages(rollout.rewards, n)
        for g, group in enumerate(buffer.add(rollout, advantages, n, step=step)):
            stored[group.prompt] = (rollout, slice(g * n, (g + 1) * n), advantages[g * n : (g + 1) * n])
    chosen = buffer.sample(5, 2)
    length = max(first.padded.input_ids.shape[1], second.padded.input_ids.shape[1])
    out = assemble(chosen, PAD, length, _filler(2, 2))
    for block, group in enumerate(chosen):
        rollout, rows, advantages = stored[group.prompt]
        here, t = slice(block * n, (block + 1) * n), rollout.padded.input_ids.shape[1]
        assert torch.equal(out.rewards[here], rollout.rewards[rows])  # the group's samples, in their order
        assert torch.equal(out.padded.input_ids[here, :t], rollout.padded.input_ids[rows])
        assert torch.equal(out.policy_version[here], rollout.policy_version[rows])
        assert torch.equal(group.tensors["advantages"], advantages)
    assert torch.equal(grpo_advantages(out.rewards, n), torch.cat([g.tensors["advantages"] for g in chosen])), seed


# ---- 7. no importance weights ------------------------------------------------------------------------------------


def test_replayed_samples_carry_mu_and_versions_unweighted():
    """Whatever the priority, an assembled batch is the stored samples: mu (rollout_logprobs) and the versions
    feed the decoupled correction as sampled, and the Rollout holds nothing beyond its dataclass fields (no
    PER weight for the loss to multiply by)."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    n = 2
    rollout = _rollout(4, n, gen, versions=torch.randint(0, 6, (4,), generator=gen).tolist())
    advantages = torch.randn(4 * n, generator=gen) * torch.tensor([0.01, 3.0, 0.2, 1.0]).repeat_interleave(n)
    outs = []
    for priority, alpha in (("uniform", 1.0), ("advantage", 4.0), ("recency", 3.0)):
        buffer = ReplayBuffer(16, 100, priority, alpha=alpha, seed=seed)
        buffer.add(rollout, advantages, n, step=6)
        chosen = sorted(buffer.sample(4, 6), key=lambda g: g.prompt)  # the same groups in the same order
        outs.append(assemble(chosen, PAD, rollout.padded.input_ids.shape[1], _filler(2, 2)))
    orig = rollout.padded
    for out in outs:
        assert type(out) is Rollout and type(out.padded) is PaddedBatch
        assert set(vars(out)) == {f.name for f in fields(Rollout)}
        assert set(vars(out.padded)) == {f.name for f in fields(PaddedBatch)}
        assert not any("weight" in f.name for f in (*fields(Rollout), *fields(PaddedBatch)))
        assert torch.equal(out.padded.rollout_logprobs, orig.rollout_logprobs)
        assert torch.equal(out.policy_version, rollout.policy_version)
        assert torch.equal(out.rewards, rollout.rewards) and torch.equal(out.padded.loss_mask, orig.loss_mask)
        for key in ("input_ids", "attention_mask", "routes"):
            assert torch.equal(getattr(out.padded, key), getattr(orig, key)), key


# ---- 8. bad input ------------------------------------------------------------------------------------------------


def test_bad_input_is_refused_with_a_message():
    gen = torch.Generator().manual_seed(_seed())
    buffer = ReplayBuffer(16, 100)
    unscored = _rollout(2, 3, gen)
    unscored.rewards = None
    with pytest.raises(ValueError, match="rewards"):
        buffer.add(unscored, torch.zeros(6), 3, step=0)
    with pytest.raises(ValueError, match="6 samples are not whole groups of 4"):
        buffer.add(_rollout(2, 3, gen), torch.zeros(6), 4, step=0)
    with pytest.raises(ValueError, match=r"advantages \(2,\) must be one per sample \(6,\)"):
        buffer.add(_rollout(2, 3, gen), torch.zeros(2), 3, step=0)  # one per group instead of per sample
    assert buffer.groups == [] and buffer.prompt_rewards == {}  # nothing half-added
    with pytest.raises(ValueError, match="'bogus': choose one of uniform, recency, advantage, rarity, mixed"):
        ReplayBuffer(16, 100, priority="bogus")
    buffer.add(_rollout(2, 3, gen), torch.zeros(6), 3, step=0)
    with pytest.raises(ValueError, match="3 groups asked of 2"):
        buffer.sample(3, 0)
    assert len(buffer.sample(2, 0)) == 2


def test_fresh_share_is_not_rounded_up_by_float_noise():
    from moe_rl.rollout.buffer import fresh_count

    assert 0.14 * 50 > 7 and fresh_count(0.14, 50) == 7
    assert fresh_count(0.5, 3) == 2 and fresh_count(0.0, 8) == 0 and fresh_count(1.0, 8) == 8
