"""LoRA on the megatron actor (actor.lora) at world size 1, fp32: fresh random adapters with B != 0 against
transformers + PEFT (attention: the same adapter weights through PEFT's own LoRA layers) and against transformers on
the merged export (every target: dense MLP, routed and shared experts); only the adapters train; the adapter-only
checkpoint; the PEFT folder; bad settings refused before the model is built."""

from __future__ import annotations

import json

import peft
import pytest
import torch

from moe_rl.actor import lora
from moe_rl.actor.actor import Actor
from moe_rl.actor.config import LoraConfig, ParallelConfig
from moe_rl.actor.forward import run_schedule, split_microbatches
from moe_rl.actor.hf_export import write_hf_folder, write_peft_folder
from moe_rl.actor.model import get_converter, load_hf_config, load_model
from moe_rl.actor.weights import is_adapter_param
from moe_rl.common.batch import PaddedBatch
from moe_rl.common.errors import ConfigError
from moe_rl.config import TrainConfig
from moe_rl.objectives import Objective
from moe_rl.trainer import checkpoint
from tests.reference import load_hf, random_batch

RANK, ALPHA = 4, 8.0
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _seed() -> int:
    return int(torch.randint(0, 2**31, ()).item())


def _lora_model(path, targets, seed):
    m = load_model(path, ParallelConfig())
    sites = lora.attach(m.chunks, LoraConfig(rank=RANK, alpha=ALPHA, targets=targets))
    lora.init_adapters(m.chunks, seed, b_std=0.05)  # B != 0: the adapters change the output
    return m, sites


def _logits(chunks, ids, mask, vocab, loss_weights=None):
    """The actor's logits [B, T, vocab]; with `loss_weights`, also the backward of sum(logits * weights)."""
    out = []

    def step(logits, mb):
        lg = logits[..., :vocab]
        out.append(lg.detach())
        loss = (lg * loss_weights).sum() if loss_weights is not None else lg.new_zeros(())
        return loss, {}

    with torch.no_grad() if loss_weights is None else torch.enable_grad():
        run_schedule(chunks, split_microbatches(ids, mask, ids.shape[0]), step, forward_only=loss_weights is None)
    return out[0]


def _peft_model(path, tensors):
    hf = load_hf(path)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=ATTENTION))
    state = {f"base_model.model.{k.removesuffix('.weight')}.default.weight": v for k, v in tensors.items()}
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys[:3]
    assert sum("lora_" in k for k in model.state_dict()) == len(state)  # every PEFT adapter got its weights
    return model


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_attention_adapters_match_peft_logits_logprobs_and_gradients(arch, tiny_models, world1):
    path = tiny_models[arch]
    m, sites = _lora_model(path, ["attention"], _seed())
    assert {s.target for s in sites} == {"attention"}
    vocab = m.hf_config.vocab_size
    ids, mask = random_batch(vocab, 4, 13, _seed())
    weights = torch.randn(*ids.shape, vocab) * mask[..., None]
    logits = _logits(m.chunks, ids, mask, vocab, weights)
    tensors = lora.hf_adapter_tensors(m.chunks, m.conv)
    ref_model = _peft_model(path, tensors)
    ref = ref_model(input_ids=ids, attention_mask=mask).logits
    (ref * weights).sum().backward()
    with torch.no_grad():
        base = load_hf(path)(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    scale = ref[real].abs().max().item()
    assert (ref - base)[real].abs().max() > 0.1  # the adapters matter
    assert (logits - ref.detach())[real].abs().max().item() <= 1e-5 * max(1.0, scale)
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    ref_lp = torch.log_softmax(ref.detach(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    # fp32 noise scales with the logits' size, as for the logits above (a log-prob of -10 differs by ~1e-5 in fp32)
    assert ((lp - ref_lp) * mask[:, 1:]).abs().max() <= 1e-5 * max(1.0, scale)

    # gradients: B per HF projection; A of the fused linear_qkv is shared by q/k/v, so its gradient is their sum
    grads = {n: p.grad for n, p in ref_model.named_parameters() if "lora_" in n}
    for local, _, adapter in lora.adapters(m.chunks):  # world 1: local names are global
        hf = m.conv.hf_names(f"{local}.weight")  # q/k/v (linear_qkv) or o (linear_proj)
        modules = [f"base_model.model.{n.removesuffix('.weight')}" for n in hf]
        ref_a = sum(grads[f"{mod}.lora_A.default.weight"] for mod in modules)
        parts = {n: grads[f"{mod}.lora_B.default.weight"] for n, mod in zip(hf, modules, strict=True)}
        ref_b = m.conv.to_mcore(f"{local}.weight", parts.get, 0)  # B's rows in megatron's q/k/v interleaving
        for got, want, what in ((adapter.a.grad, ref_a, "A"), (adapter.b.grad, ref_b, "B")):
            rel = ((got - want).abs().max() / want.abs().max()).item()
            assert rel <= 1e-4, f"{local} {what}: relative gradient error {rel:.2e}"


@pytest.mark.parametrize(
    ("arch", "targets", "kinds"),
    [
        ("qwen3_moe", ["all", "router"], {"attention", "mlp", "experts", "router"}),
        ("glm4_moe", ["all"], {"attention", "mlp", "experts", "shared_experts"}),
        ("glm4_moe", ["router"], {"router"}),  # sigmoid scores with an expert bias
    ],
)
def test_every_target_matches_transformers_on_the_merged_export(arch, targets, kinds, tiny_models, world1, tmp_path):
    """targets=all: attention, the dense layers' MLP, every routed expert (and GLM's shared experts), and the router
    when listed; transformers on the merged HF folder (W + (alpha / r) B A written by the export) gives the actor's
    logits."""
    path = tiny_models[arch]
    m, sites = _lora_model(path, targets, _seed())
    found = {s.target for s in sites}
    assert found == kinds, found
    ids, mask = random_batch(m.hf_config.vocab_size, 4, 13, _seed())
    logits = _logits(m.chunks, ids, mask, m.hf_config.vocab_size)
    merged = write_hf_folder(m.chunks, m.conv, path, tmp_path / "merged")
    with torch.no_grad():
        ref = load_hf(merged)(input_ids=ids, attention_mask=mask).logits
        base = load_hf(path)(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert (ref - base)[real].abs().max() > 0.1
    assert (logits - ref)[real].abs().max().item() <= 1e-5 * max(1.0, ref[real].abs().max().item())


def test_peft_folder_loads_with_peft_and_gives_the_actor_logits(tiny_models, world1, tmp_path):
    path = tiny_models["qwen3_moe"]
    m, _ = _lora_model(path, ["attention"], _seed())
    cfg = LoraConfig(rank=RANK, alpha=ALPHA, targets=["attention"])
    folder = write_peft_folder(m.chunks, m.conv, path, tmp_path / "adapter", cfg)
    meta = json.loads((folder / "adapter_config.json").read_text())
    assert meta["base_model_name_or_path"] == str(path.resolve()) and sorted(meta["target_modules"]) == sorted(
        ATTENTION
    )
    model = peft.PeftModel.from_pretrained(load_hf(meta["base_model_name_or_path"]), folder)
    ids, mask = random_batch(m.hf_config.vocab_size, 4, 13, _seed())
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    logits = _logits(m.chunks, ids, mask, m.hf_config.vocab_size)
    real = mask.bool()
    assert (logits - ref)[real].abs().max().item() <= 1e-5 * max(1.0, ref[real].abs().max().item())

    everything, _ = _lora_model(path, ["all"], 0)
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.mlp\.experts.*PEFT 0\.21 cannot hold"):
        write_peft_folder(everything.chunks, everything.conv, path, tmp_path / "refused", cfg)
    assert not (tmp_path / "refused").exists()


def _batch(vocab: int) -> PaddedBatch:
    ids, attn = random_batch(vocab, batch=8, length=14, seed=_seed(), min_len=8)
    loss_mask = attn.float().clone()
    loss_mask[:, :4] = 0  # 4 prompt tokens
    return PaddedBatch(ids, attn, loss_mask, torch.zeros(ids.shape), None)


def _lora_actor(path, rank=RANK):
    cfg = TrainConfig()
    cfg.actor.router_replay, cfg.actor.mini_batches, cfg.actor.micro_batch_size = "off", 2, 4
    cfg.actor.lr = 1e-2
    cfg.actor.lora = LoraConfig(rank=rank, alpha=ALPHA, targets=["all", "router"])  # every kind
    return cfg, Actor(cfg.actor, cfg.model, cfg.parallel, path, record_routes=False)


def test_only_the_adapters_train_and_the_optimizer_holds_only_theirs(tiny_models, world1, tmp_path):
    """Five RL updates: every base weight bitwise the HF folder's, every adapter moved; the optimizer's state is the
    adapters' Adam moments (fp32) and nothing else; the checkpoint holds the adapters alone and resumes exactly."""
    path = tiny_models["qwen3_moe"]
    cfg, actor = _lora_actor(path)
    objective = Objective(cfg.algorithm, group_size=4)
    padded = _batch(actor.hf_config.vocab_size)
    padded.rollout_logprobs = actor.old_logprobs(padded).logprobs
    factors = {n: p for c in actor.chunks for n, p in c.named_parameters() if is_adapter_param(n)}
    b_before = {n: p.detach().clone() for n, p in factors.items()}
    for _ in range(5):
        old = actor.old_logprobs(padded)
        m = actor.train(padded, old, torch.randn(8), objective, lambda skipped, i: skipped)
        assert m["actor/skipped_steps"] == 0
    fresh = load_model(path, ParallelConfig())
    base = {n: p for c in actor.chunks for n, p in c.named_parameters() if not is_adapter_param(n)}
    for (n, p), (n0, p0) in zip(base.items(), (x for c in fresh.chunks for x in c.named_parameters()), strict=True):
        assert n == n0 and torch.equal(p, p0), f"base weight {n} changed"
    assert all(not torch.equal(p, b_before[n]) for n, p in factors.items() if n.endswith(".b")), "a B did not move"

    held = [p for opt in actor.optimizer.chained_optimizers for g in opt.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in held} == {id(p) for p in factors.values()}
    state_bytes = sum(
        t.numel() * t.element_size()
        for opt in actor.optimizer.chained_optimizers
        for s in opt.optimizer.state.values()
        for k, t in s.items()
        if k != "step"
    )
    adapter_elements = sum(p.numel() for p in factors.values())
    assert state_bytes == 8 * adapter_elements  # Adam's two fp32 moments per adapter element

    folder = tmp_path / "ckpt"
    checkpoint.save_part(folder, actor.chunks, actor.optimizer)
    _, again = _lora_actor(path)
    checkpoint.load_part(folder, again.chunks, again.optimizer)
    for (n, p), q in zip(
        factors.items(),
        (p for c in again.chunks for n, p in c.named_parameters() if is_adapter_param(n)),
        strict=True,
    ):
        assert torch.equal(p, q), n
    old = actor.old_logprobs(padded)
    adv = torch.randn(8)
    first = actor.train(padded, old, adv, objective, lambda skipped, i: skipped)
    second = again.train(padded, again.old_logprobs(padded), adv, objective, lambda skipped, i: skipped)
    assert {k: v for k, v in first.items() if not k.startswith("perf/")} == {
        k: v for k, v in second.items() if not k.startswith("perf/")
    }  # the next update after the resume: the same, bit for bit (optimizer state included)
    saved = checkpoint._saved_keys(folder / "model")
    assert saved and all(k.endswith((".lora.a", ".lora.b")) for k in saved), saved[:4]


def test_checkpoints_of_the_other_kind_are_refused(tiny_models, world1, tmp_path):
    path = tiny_models["qwen3_moe"]
    _, actor = _lora_actor(path)
    checkpoint.save_part(tmp_path / "lora", actor.chunks, actor.optimizer)
    full = load_model(path, ParallelConfig())
    with pytest.raises(checkpoint.CheckpointError, match="adapters only .*actor.lora"):
        checkpoint.load_model(tmp_path / "lora", full.chunks)


@pytest.mark.parametrize(
    ("arch", "settings", "message"),
    [
        ("mixtral", {"targets": ["shared_experts"]}, r"\['shared_experts'\] match no linear of this model"),
        ("mixtral", {"targets": ["mlp"]}, r"\['mlp'\] match no linear"),
        ("qwen3_moe", {"rank": 4096}, r"actor.lora.rank=4096 is larger than the attention linears"),
        ("qwen3_moe", {"rank": 65, "targets": ["experts"]}, r"rank=65 is larger than the experts linears .*at most 64"),
        ("qwen3_moe", {"rank": 9, "targets": ["router"]}, r"rank=9 is larger than the router linears .*at most 8"),
    ],
)
def test_settings_the_model_cannot_take_are_refused_before_it_is_built(arch, settings, message, tiny_models):
    conv = get_converter(load_hf_config(tiny_models[arch]))
    with pytest.raises(ConfigError, match=message):
        lora.check_model(conv, LoraConfig(**{"rank": 8, **settings}))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"rank": -1}, "actor.lora.rank: -1: must be >= 1"),
        ({"dropout": 1.0}, r"actor.lora.dropout: 1.0: must be in \[0, 1\)"),
        ({"alpha": 0.0}, "actor.lora.alpha: 0.0: must be > 0"),
        ({"targets": ["q_proj"]}, r"actor.lora.targets: \['q_proj'\]: choose from"),
        ({"weight_sync": "adapter"}, "actor.lora.weight_sync: adapter: not built"),
    ],
)
def test_bad_lora_settings_name_the_key(settings, message):
    with pytest.raises(ConfigError, match=message):
        LoraConfig(**{"rank": 8, **settings}).check()


def test_lora_with_transformer_engine_is_refused_naming_the_key():
    """On a GPU (simulated) Transformer Engine fuses the input norm into the linears LoRA adapts: refused by the
    config check, before anything is built."""
    from moe_rl.common.platform import as_on_cuda
    from moe_rl.config.validate import validate

    cfg = TrainConfig()
    cfg.actor.lora.rank = 8
    cfg.actor.packing = False
    with as_on_cuda(), pytest.raises(ConfigError, match=r"actor.lora.rank: 8 with model.transformer_engine=true"):
        validate(cfg, world_size=2)


def test_the_planner_counts_the_adapters_as_the_actor_holds_them(tiny_models, world1):
    """moe-rl-plan's LoRA rows for the tiny model at world 1 equal the actor's bytes: fp32 factors, their gradients and
    Adam's two moments; the base's parameters stay, with no gradient or optimizer row of their own."""
    from moe_rl.common.machine import resolve
    from moe_rl.common.platform import this_machine
    from moe_rl.plan.layout import Layout
    from moe_rl.plan.memory import trainer_table
    from moe_rl.plan.params import count
    from moe_rl.plan.spec import load_spec

    path = tiny_models["qwen3_moe"]
    cfg, actor = _lora_actor(path, rank=8)
    resolve(cfg, this_machine())  # the `auto` settings, as the trainer resolves them before planning its preflight
    elements = sum(p.numel() for c in actor.chunks for n, p in c.named_parameters() if is_adapter_param(n))
    spec = load_spec(str(path))
    layout = Layout(gpus=1, tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=1, engines=1, engine_tp=1)
    rows = {r.name: r.bytes for r in trainer_table(spec, count(spec), cfg, layout, 0).rows}
    assert rows["LoRA adapters"] == rows["gradients"] == 4 * elements and rows["optimizer state"] == 8 * elements
    base = sum(p.numel() for c in actor.chunks for n, p in c.named_parameters() if not is_adapter_param(n))
    assert rows["parameters"] == 4 * base


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_adapter_gradients_are_the_same_with_activation_recompute(recompute, tiny_models, world1):
    """model.recompute re-runs the checkpointed layers in the backward: the adapters' hooks with them. (Without an
    input that requires grad megatron's recompute skipped the backward and the adapters got no gradient.)"""
    from moe_rl.actor.model import ModelOptions

    path, seed = tiny_models["qwen3_moe"], _seed()
    grads = []
    for opts in (ModelOptions(), ModelOptions(recompute=recompute)):
        m = load_model(path, ParallelConfig(), opts)
        lora.attach(m.chunks, LoraConfig(rank=RANK, alpha=ALPHA))
        lora.init_adapters(m.chunks, seed, b_std=0.05)
        vocab = m.hf_config.vocab_size
        ids, mask = random_batch(vocab, 4, 13, seed)
        _logits(m.chunks, ids, mask, vocab, torch.randn(*ids.shape, vocab, generator=torch.Generator().manual_seed(1)))
        grads.append({n: p.grad for c in m.chunks for n, p in c.named_parameters() if is_adapter_param(n)})
    assert grads[0].keys() == grads[1].keys()
    for n, g in grads[0].items():
        assert grads[1][n] is not None, f"{n}: no gradient under recompute"
        assert torch.allclose(grads[1][n], g, rtol=1e-5, atol=1e-7), n


def test_the_reference_policy_is_the_base_model_with_the_adapters_off(tiny_models, world1):
    """algorithm.kl_coef > 0 under LoRA: no second model; pi_ref is the actor with its adapters off, equal to pi_old
    while B = 0 (the first step) and apart from it once the adapters trained."""
    path = tiny_models["qwen3_moe"]
    cfg = TrainConfig()
    cfg.actor.router_replay, cfg.actor.mini_batches, cfg.actor.micro_batch_size, cfg.actor.lr = "off", 2, 4, 1e-2
    cfg.actor.lora = LoraConfig(rank=RANK, alpha=ALPHA)
    cfg.algorithm.kl_coef = 0.1
    actor = Actor(cfg.actor, cfg.model, cfg.parallel, path, record_routes=False, reference=True)
    assert actor.reference[0] is actor.chunks
    objective = Objective(cfg.algorithm, group_size=4)
    padded = _batch(actor.hf_config.vocab_size)
    padded.rollout_logprobs = actor.old_logprobs(padded).logprobs
    old = actor.old_logprobs(padded)
    assert torch.equal(actor.ref_logprobs(padded, old), old.logprobs)  # B = 0: the base model
    m = actor.train(padded, old, torch.randn(8), objective, lambda skipped, i: skipped, actor.ref_logprobs(padded, old))
    assert m["actor/first_minibatch_kl_ref"] == 0.0 and m["actor/kl_ref"] > 0.0
    old = actor.old_logprobs(padded)
    ref = actor.ref_logprobs(padded, old)
    assert not torch.equal(ref, old.logprobs)
    base = load_model(path, ParallelConfig())
    with torch.no_grad():
        from moe_rl.actor.forward import compute_logprobs

        fresh = compute_logprobs(base.chunks, padded.input_ids, padded.attention_mask, 4, with_entropy=False)
    assert torch.allclose(ref, fresh["logprobs"], atol=1e-6)  # the frozen base, whatever the adapters learned
