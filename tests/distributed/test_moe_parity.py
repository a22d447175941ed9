"""A mixture of experts (Qwen3-MoE, Mixtral, Qwen2-MoE with its gated shared expert and a dense layer
among the sparse ones, GLM-4.5 MoE with its biased sigmoid router, DeepSeek-V3 with GLM's router and
multi-latent attention, DeepSeek-V2 with its grouped softmax router, gpt-oss with its biases, sinks, sliding
windows and clamped experts) gives the same forward and
training step in every parallel layout as in a single process: EP=2 (the two ranks hold experts
0-1 and 2-3 and exchange tokens), EP=2 with the distributed optimizer, TP=2 with sequence parallelism
(Megatron-core trains MoE layers with TP only under SP), the same with the experts unsplit over the TP ranks
(parallel.etp=1; gpt-oss's only TP layout), and PP=2. Qwen2-MoE's shared expert is split
over TP ranks like a dense MLP and replicated over EP ranks; its gate weight is replicated on every
rank, and under SP each TP rank sees only part of the sequence, so a gate gradient not summed over
TP leaves the ranks' copies different after the step (by 2e-3 when tried: caught below).

The batch is chosen so that under EP=2 the two data-parallel ranks pack different shapes (one row
of 46 tokens vs two rows of at most 27): expert parallelism exchanges tokens in equal-size
collectives, so the trainer pads rows and adds a row without samples (checked below).

Tolerances (fp32), as in test_parity.py: log-probs 2e-5, loss 1e-6, gradient norm 1e-5 relative.
Weights after one Adam step: a rounding-level gradient difference d changes the first Adam step
by at most lr * d / eps, most where a clipped gradient is near or below eps = 1e-8: up to ~2e-6
for Qwen3-MoE (the dense Qwen3 model at TP=2 + SP shows the same), and 1.2e-5 for Qwen2-MoE at
TP=2 + SP, at one element of its untied output layer whose gradient is ~1e-10 (the step there is
1e-5 and 2e-5 instead of lr = 1e-3). An update from a wrong gradient (a lost expert, a token sent
to the wrong rank) differs by up to 2 * lr = 2e-3. We allow 3e-5.
The gradient's scale, to which Adam's first step is blind, is checked by the gradient norm.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_spawned
from tests.distributed.test_family_parity import CHECKPOINTS as FAMILY_CHECKPOINTS
from tests.distributed.test_gpt_oss import ARCH as GPT_OSS

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

MODELS = {
    "qwen3_moe": dict(family="qwen3_moe", num_layers=4, tie_word_embeddings=True, num_experts=4,
                      moe_ffn_hidden_size=64, moe_router_topk=2),
    "mixtral": dict(family="mixtral", num_layers=4, tie_word_embeddings=False, num_experts=4, ffn_hidden_size=64,
                    moe_ffn_hidden_size=64, moe_router_topk=2),
    # layer 2 dense (HF mlp_only_layers=[2]): replicated over EP ranks, split over TP like any dense MLP
    "qwen2_moe": dict(family="qwen2_moe", num_layers=4, tie_word_embeddings=False, num_experts=4,
                      moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=96, moe_router_topk=2,
                      moe_norm_topk_prob=False, moe_dense_layers=[2]),
    # GLM-4.5 MoE: sigmoid router with a (frozen) selection bias, two expert groups, scaled weights; two
    # shared experts without a gate; layer 0 dense; RoPE on half of each head; QK-norm (GLM-4.5's, not Air's)
    "glm4_moe": dict(family="glm4_moe", num_layers=4, tie_word_embeddings=False, num_experts=4,
                     moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=128, moe_router_topk=2,
                     moe_dense_layers=[0], moe_router_num_groups=2, moe_router_group_topk=1,
                     moe_routed_scaling_factor=2.5, rotary_percent=0.5, qk_layernorm=True),
    # DeepSeek-V3: multi-latent attention (latents and their norms replicated over TP ranks, up projections
    # split by heads) with YaRN, GLM's router; layer 0 dense, one shared expert (test_family_parity's checkpoint);
    # auxiliary-loss-free balancing on (GLM-4.5's bias stays frozen)
    "deepseek_v3": {**FAMILY_CHECKPOINTS["deepseek_v3"], "moe_router_bias_update_rate": 1e-3},
    # DeepSeek-V2: direct queries, softmax router over 8 experts in 4 groups, weights scaled, not renormalised
    "deepseek_v2": dict(family="deepseek_v2", num_layers=4, tie_word_embeddings=False, num_query_groups=4,
                        num_experts=8, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=64,
                        moe_router_topk=3, moe_norm_topk_prob=False, moe_router_num_groups=4, moe_router_group_topk=2,
                        moe_routed_scaling_factor=1.5, moe_dense_layers=[0], q_lora_rank=None, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24),
    # gpt-oss: biases everywhere (experts unsplit over TP: etp=1), attention sinks split over TP with the heads,
    # sliding windows (16 tokens) in layers 0 and 3, YaRN, clamped SwiGLU experts (test_gpt_oss's architecture)
    "gpt_oss": GPT_OSS,
}
LAYOUTS = {
    "ep2": dict(tp=1, pp=1, ep=2, sequence_parallel=False, distopt=False),
    "ep2_distopt": dict(tp=1, pp=1, ep=2, sequence_parallel=False, distopt=True),
    "tp2_sp": dict(tp=2, pp=1, ep=1, sequence_parallel=True, distopt=False),
    # experts unsplit over the TP ranks (parallel.etp=1): each TP rank runs whole experts on its sequence shard
    "tp2_sp_etp1": dict(tp=2, pp=1, ep=1, sequence_parallel=True, distopt=False, etp=1),
    "pp2": dict(tp=1, pp=2, ep=1, sequence_parallel=False, distopt=False),
}
REFERENCE = dict(tp=1, pp=1, ep=1, sequence_parallel=False, distopt=False)
LENGTHS = (31, 24, 4, 27, 7, 4)
MICRO_BATCH_TOKENS = 48


# Megatron's load-balancing loss (depends on the micro-batches by design: not compared across layouts)
AUX_LOSS = {"qwen3_moe_aux_loss": {**MODELS["qwen3_moe"], "moe_aux_loss_coeff": 0.01}}


def _model_cfg(model: str):
    from megatron_rl.config.schema import ModelConfig

    return ModelConfig(**{**MODELS, **AUX_LOSS}[model])


def _initial_weights(model: str):
    """transformers' random initialisation; GLM-4.5's selection bias (0 there) drawn at random, small
    enough that every expert still gets tokens, large enough to move the choice (layer 1's groups
    get 61:36 tokens without it, 34:63 with it, when tried)."""
    from megatron_rl.models.hf import random_state_dict

    full = random_state_dict(_model_cfg(model), seed=3)
    gen = torch.Generator().manual_seed(4)
    for key in sorted(full):
        if key.endswith(".router.expert_bias"):
            full[key] = 0.01 * torch.randn(full[key].shape, generator=gen)
    return full


def _samples():
    from megatron_rl.trainer.packing import Sample

    gen = torch.Generator().manual_seed(0)
    samples = []
    for n in LENGTHS:
        tokens = torch.randint(0, 128, (n,), generator=gen)
        mask = torch.ones(n - 1)
        mask[: n // 3] = 0.0  # a "prompt" part that does not count in the loss
        samples.append(Sample(tokens, mask))
    return samples


def _replica_drift(module, groups) -> float:
    """Largest difference between copies of a parameter that ranks should hold identically: a dense parameter
    not split over TP on the TP ranks; an expert's parameter on the expert-data-parallel ranks (those holding
    the same expert and the same expert-TP shard); an expert adapter's group-whole factor on its expert-TP
    ranks. (full_state_dict reads one copy, so a rank that stepped differently would go unseen there.)"""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    def spread(param, group) -> float:
        size = dist.get_world_size(group)
        if size == 1:
            return 0.0
        parts = [torch.empty_like(param.data) for _ in range(size)]
        dist.all_gather(parts, param.data.contiguous(), group=group)
        return max((p - parts[0]).abs().max().item() for p in parts)

    drift = 0.0
    for name, param in module.named_parameters():
        split = getattr(param, "tensor_model_parallel", False)
        if ".mlp.experts." in name:
            drift = max(drift, spread(param, ps.get_expert_data_parallel_group()))
            if groups.etp_size > 1 and not split:
                drift = max(drift, spread(param, groups.etp_group))
        elif not split:
            drift = max(drift, spread(param, groups.tp_group))
    return drift


def _worker(rank: int, world: int, model: str, layouts: dict, out_path: str) -> None:
    from megatron_rl.config.schema import OptimizerConfig
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    model_cfg = _model_cfg(model)
    full = _initial_weights(model)
    results = {}
    for name, layout in layouts.items():
        groups = state.initialize(layout["tp"], layout["pp"], layout.get("cp", 1), ep=layout["ep"],
                                  etp=layout.get("etp", 1 if model_cfg.linear_bias else None),
                                  sequence_parallel=layout["sequence_parallel"])
        trainer = Trainer(model_cfg, OptimizerConfig(lr=1e-3, clip_grad=1.0), groups,
                          TrainerOptions(micro_batch_tokens=MICRO_BATCH_TOKENS,
                                         use_distributed_optimizer=layout["distopt"]))
        trainer.load_full_state_dict(full)
        samples = _samples()
        logprobs, entropy = trainer.forward_logprobs(samples, with_entropy=True)
        metrics = trainer.train_step(samples)
        weights = trainer.full_state_dict()
        results[name] = dict(logprobs=logprobs, entropy=entropy, metrics=metrics, weights=weights,
                             replica_drift=_replica_drift(trainer.module, groups))
        state.destroy()
    if rank == 0:
        torch.save(results, out_path)


@pytest.fixture(scope="module", params=sorted(MODELS))
def results(request, tmp_path_factory):
    """(model name, single-process run, runs per layout)."""
    out = tmp_path_factory.mktemp(f"moe_parity_{request.param}")
    run_spawned(_worker, 1, request.param, {"ref": REFERENCE}, str(out / "ref.pt"))
    run_spawned(_worker, 2, request.param, LAYOUTS, str(out / "layouts.pt"))
    return request.param, torch.load(out / "ref.pt")["ref"], torch.load(out / "layouts.pt")


def test_expert_parallel_ranks_pack_different_shapes():
    """Guards the padding path: without equal shapes the EP=2 run would hang or fail."""
    from megatron_rl.trainer.packing import packed_shape, split_for_data_parallel

    shares = split_for_data_parallel(list(LENGTHS), 2)
    (rows_0, len_0), (rows_1, len_1) = [packed_shape([LENGTHS[i] for i in s], MICRO_BATCH_TOKENS) for s in shares]
    assert rows_0 != rows_1 and len_0 != len_1


def test_reference_logprobs_match_transformers(results):
    """The single-process reference itself: compared with transformers' model on the same weights."""
    from megatron_rl.models.hf import build_hf_model

    model, ref, _ = results
    hf = build_hf_model(_model_cfg(model), seed=3)
    full = _initial_weights(model)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            if f"decoder.layers.{i}.mlp.router.expert_bias" in full:
                assert full[f"decoder.layers.{i}.mlp.router.expert_bias"].abs().max() > 0.005
                layer.mlp.gate.e_score_correction_bias.copy_(full[f"decoder.layers.{i}.mlp.router.expert_bias"])
    for sample, lp, ent in zip(_samples(), ref["logprobs"], ref["entropy"], strict=True):
        with torch.no_grad():
            logits = hf(sample.tokens[None]).logits[0, :-1].double()
        logp = torch.log_softmax(logits, -1)
        expected = logp.gather(-1, sample.tokens[1:, None])[:, 0]
        assert torch.allclose(lp.double(), expected, atol=2e-5), (lp - expected).abs().max()
        assert torch.allclose(ent.double(), -(logp.exp() * logp).sum(-1), atol=2e-5)


def test_reference_step_moves_every_weight_and_expert(results):
    """Guards the comparisons below against a step that changed nothing (or left an expert unused)."""
    model, ref, _ = results
    initial = _initial_weights(model)
    sparse = 4 - len(MODELS[model].get("moe_dense_layers", []))
    experts = MODELS[model]["num_experts"]
    per_expert = 4 if _model_cfg(model).linear_bias else 2  # fc1, fc2 (and their biases)
    assert sum(".local_experts." in k for k in ref["weights"]) == sparse * experts * per_expert
    # per sparse layer: fc1, fc2 (and gate_weight)
    shared = {"qwen2_moe": 3, "glm4_moe": 2, "deepseek_v3": 2, "deepseek_v2": 2}.get(model, 0)
    assert sum(".shared_experts." in k for k in ref["weights"]) == sparse * shared
    for i in MODELS[model].get("moe_dense_layers", []):
        assert {k for k in ref["weights"] if k.startswith(f"decoder.layers.{i}.mlp.")} == {
            f"decoder.layers.{i}.mlp.linear_fc{j}.weight" for j in (1, 2)}
    rate = MODELS[model].get("moe_router_bias_update_rate", 0.0)
    loads = _hf_expert_loads(model) if rate else {}
    assert not rate or loads
    for key, value in ref["weights"].items():
        if key.endswith(".router.expert_bias"):
            if rate == 0:  # GLM-4.5's selection bias stays the checkpoint's
                assert torch.equal(value, initial[key]), key
            else:  # DeepSeek-V3's moves by the rate towards balance: see _hf_expert_loads
                load = loads[int(key.split(".")[2])]
                assert load.sum() == sum(LENGTHS) * MODELS[model]["moe_router_topk"]
                expected = initial[key] + rate * torch.sign(load.mean() - load)
                assert torch.allclose(value, expected, atol=1e-7), (key, load, value - initial[key])
            continue
        assert (value - initial[key]).abs().max() > 1e-5, f"{key} did not change"


def _hf_expert_loads(model: str) -> dict[int, torch.Tensor]:
    """Tokens of the samples (padding excluded) that transformers' model on the initial weights routes to
    each expert, per sparse layer (counted from its routers' chosen indices). With
    moe_router_bias_update_rate, the step moves each expert's selection bias by the rate towards balance (up
    if the batch's tokens chose it less often than the mean, down if more), counting the tokens as
    transformers routes them: padding rows and padded positions (which the EP and TP layouts add, and whose
    weights the layouts' tests compare) must not count (with them counted, two experts of layer 2 moved the
    wrong way)."""
    from megatron_rl.models.hf import build_hf_model

    hf = build_hf_model(_model_cfg(model), seed=3)
    full = _initial_weights(model)
    loads, hooks = {}, []
    for i, layer in enumerate(hf.model.layers):
        if f"decoder.layers.{i}.mlp.router.expert_bias" not in full:
            continue
        with torch.no_grad():
            layer.mlp.gate.e_score_correction_bias.copy_(full[f"decoder.layers.{i}.mlp.router.expert_bias"])
        loads[i] = torch.zeros(MODELS[model]["num_experts"])

        def count(module, args, output, i=i):
            loads[i] += torch.bincount(output[2].reshape(-1), minlength=len(loads[i])).float()
        hooks.append(layer.mlp.gate.register_forward_hook(count))
    with torch.no_grad():
        for sample in _samples():
            hf(sample.tokens[None])
    for hook in hooks:
        hook.remove()
    return loads


def test_load_balancing_loss_with_rows_without_samples(tmp_path):
    """EP=2 packs a row without samples on one rank (see test_expert_parallel_ranks_pack_different_shapes): with
    the load-balancing loss on, that row has no real token, and the step stays finite (Megatron-core divided by
    its zero token count: NaN gradients) while the loss still changes the gradient."""
    import math

    layout = {"ep2": LAYOUTS["ep2"]}
    run_spawned(_worker, 2, "qwen3_moe_aux_loss", layout, str(tmp_path / "aux.pt"))
    run_spawned(_worker, 2, "qwen3_moe", layout, str(tmp_path / "plain.pt"))
    aux, plain = torch.load(tmp_path / "aux.pt")["ep2"], torch.load(tmp_path / "plain.pt")["ep2"]
    assert math.isfinite(aux["metrics"]["grad_norm"]) and math.isfinite(aux["metrics"]["loss"])
    assert all(torch.isfinite(w).all() for w in aux["weights"].values())
    assert aux["metrics"]["grad_norm"] != pytest.approx(plain["metrics"]["grad_norm"], rel=1e-4)


def test_tensor_pipeline_and_sequence_parallel_together(tmp_path):
    """DeepSeek-V3 (selection bias updated) at TP=2 + SP x PP=2 on four ranks: the second stage's routers get
    their sequence shard of the padding mask from the trainer (GPTModel splits it on the first stage only);
    the step equals the single-process one, bias update included."""
    run_spawned(_worker, 1, "deepseek_v3", {"ref": REFERENCE}, str(tmp_path / "ref.pt"))
    layout = dict(tp=2, pp=2, ep=1, sequence_parallel=True, distopt=False)
    run_spawned(_worker, 4, "deepseek_v3", {"tp2_pp2_sp": layout}, str(tmp_path / "run.pt"))
    ref, run = torch.load(tmp_path / "ref.pt")["ref"], torch.load(tmp_path / "run.pt")["tp2_pp2_sp"]
    for got, want in zip(run["logprobs"], ref["logprobs"], strict=True):
        assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()
    assert run["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
    assert run["replica_drift"] == 0.0
    for key, want in ref["weights"].items():
        assert (run["weights"][key] - want).abs().max().item() <= 3e-5, key


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logprobs_match_single_process(results, layout):
    _, ref, runs = results
    for got, want in zip(runs[layout]["logprobs"], ref["logprobs"], strict=True):
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()
    for got, want in zip(runs[layout]["entropy"], ref["entropy"], strict=True):
        assert torch.allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_loss_and_grad_norm_match_single_process(results, layout):
    _, ref, runs = results
    got, want = runs[layout]["metrics"], ref["metrics"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-6)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert got["num_tokens"] == want["num_tokens"]


def test_tensor_parallel_ranks_keep_equal_copies(results):
    """Weights every TP rank holds whole (norms, router, output biases; gpt-oss's unsplit experts) stay equal
    on both ranks after the step (they drifted apart by ~3e-6 when the ranks clipped by different norms)."""
    _, _, runs = results
    assert runs["tp2_sp"]["replica_drift"] == 0.0
    assert runs["tp2_sp_etp1"]["replica_drift"] == 0.0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_updated_weights_match_single_process(results, layout):
    _, ref, runs = results
    got, want = runs[layout]["weights"], ref["weights"]
    assert sorted(got) == sorted(want)
    for key in want:
        diff = (got[key] - want[key]).abs().max().item()
        assert diff <= 3e-5, f"{key}: max abs diff {diff:.3e}"


def _te_tagged_worker(rank: int, world: int, out_path: str) -> None:
    """TP=2 with sequence parallelism (experts split over both ranks, etp=2), the experts' down projections
    tagged as Transformer Engine tags them: load a full state dict, gather it back."""
    from megatron_rl.config.schema import OptimizerConfig
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    groups = state.initialize(2, 1, 1, ep=1, sequence_parallel=True)
    trainer = Trainer(_model_cfg("qwen3_moe"), OptimizerConfig(), groups, TrainerOptions(micro_batch_tokens=48))
    retagged = 0
    for name, param in trainer.module.named_parameters():
        if ".mlp.experts." in name and name.endswith("linear_fc2.weight"):
            param.partition_dim = 0  # TE: parallel_mode=None under Megatron's explicit expert communication
            retagged += 1
    full = _initial_weights("qwen3_moe")
    trainer.load_full_state_dict(full)
    gathered = trainer.full_state_dict()
    if rank == 0:
        torch.save({"retagged": retagged, "full": full, "gathered": gathered}, out_path)


def test_expert_down_projections_tagged_as_transformer_engine_tags_them_load_and_gather(tmp_path):
    """Transformer Engine (the GPU spec) tags an expert's linear_fc2 weight, split along its inputs, with
    partition_dim 0 (Megatron builds expert linears with parallel_mode=None; TE tags every linear that is not
    "row" so). Weight loading and gathering split it along its inputs anyway: the full state dict comes back
    as loaded. (Read from the tag, loading failed with a shape error.)"""
    run_spawned(_te_tagged_worker, 2, str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["retagged"] == 4 * 4  # four layers of four experts
    assert sorted(out["gathered"]) == sorted(out["full"])
    for name, tensor in out["full"].items():
        assert torch.equal(out["gathered"][name], tensor), name
