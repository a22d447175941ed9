"""GPU checks for colocation (run on a GPU machine: `pytest tests/gpu -q`; skipped elsewhere).

- Trainer offload/onload really moves memory: allocated GPU memory drops by at least the
  parameter + gradient + optimizer bytes after `offload()` and returns after `onload()`, twice;
  prints offload/onload GB/s.
- The hf engine's release/resume frees and re-allocates its weights on the GPU.
- With SGLang installed: `release_memory_occupation` drops GPU memory in use (seen from
  torch.cuda.mem_get_info, which includes other processes) and `resume` brings it back; started with
  enable_return_routed_experts, it returns the experts transformers' routers choose (rollout routing replay).
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on a GPU machine)", allow_module_level=True)


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


@pytest.fixture(scope="module")
def trainer():
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.models.gpt import te_available
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    device = mdist.resolve_device("cuda")
    mdist.init_distributed(mdist.dist_env_from({}), device)
    groups = state.initialize(1, 1, device=device)
    cfg = ModelConfig(num_layers=24, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16,
                      num_query_groups=4, vocab_size=32768,
                      # what moves is the same on either spec: the local one where TE is not installed
                      transformer_impl="auto" if te_available() else "local")
    t = Trainer(cfg, OptimizerConfig(), groups, TrainerOptions(micro_batch_tokens=4096))
    t.initialize_weights()
    from megatron_rl.trainer.packing import Sample

    t.train_step([Sample(torch.arange(1, 200), torch.ones(198)) for _ in range(4)])  # optimizer state exists
    return t


def test_trainer_offload_and_onload_move_memory(trainer):
    """Twice, as in every RL step: the first offload allocates the pinned host buffers that later ones reuse.
    The bytes moved count the gradient buffers, which are freed (and zeroed on onload), not copied."""
    plan = trainer.memory_plan()
    expected = sum(plan.values())
    params = sum(p.numel() for p in trainer.module.parameters())
    spec = f"{'TE' if trainer.use_te else 'local'} spec, {params / 1e6:.0f}M"
    for attempt in ("first", "second"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        moved_out = trainer.offload()
        offload_s = time.perf_counter() - start
        after = torch.cuda.memory_allocated()
        start = time.perf_counter()
        moved_in = trainer.onload()
        onload_s = time.perf_counter() - start
        restored = torch.cuda.memory_allocated()
        print(f"{spec} parameters, {attempt}: offload {moved_out / 1e9:.2f} GB in {offload_s:.3f}s "
              f"({moved_out / offload_s / 1e9:.1f} GB/s; grads {plan['grads'] / 1e9:.2f} GB of it freed); "
              f"onload {moved_in / 1e9:.2f} GB in {onload_s:.3f}s ({moved_in / onload_s / 1e9:.1f} GB/s)")
        assert before - after >= 0.9 * expected
        assert restored >= before - 0.05 * expected


def test_hf_engine_release_frees_gpu_memory(trainer):
    from megatron_rl.rollout.hf_engine import HFEngine

    engine = HFEngine(trainer.model_cfg, device="cuda")
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    engine.release_memory()
    torch.cuda.synchronize()
    released = torch.cuda.memory_allocated()
    engine.resume_memory()
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert held - released >= 0.9 * weights
    assert torch.cuda.memory_allocated() >= held - 0.05 * weights


def test_sglang_release_and_resume_memory_occupation(tmp_path):
    sglang = pytest.importorskip("sglang", reason="SGLang is not installed in this environment")
    from megatron_rl.models.hf import build_hf_model
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.data.tokenizer import load_tokenizer

    cfg = ModelConfig(num_layers=8, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16,
                      num_query_groups=4, vocab_size=128)
    hf = build_hf_model(cfg, seed=0)
    weight_bytes = sum(p.numel() for p in hf.parameters()) * 2  # SGLang serves it in bf16
    hf.save_pretrained(tmp_path)
    load_tokenizer("builtin:char").save_pretrained(tmp_path)
    engine = sglang.Engine(model_path=str(tmp_path), enable_memory_saver=True, mem_fraction_static=0.3)
    try:
        in_use = _used()
        engine.release_memory_occupation()
        released = _used()
        engine.resume_memory_occupation()
        resumed = _used()
        print(f"SGLang GPU memory: {in_use / 1e9:.2f} GB -> released {released / 1e9:.2f} GB -> "
              f"resumed {resumed / 1e9:.2f} GB")
        # weights and KV cache (mem_fraction_static of the GPU) both go
        assert in_use - released >= weight_bytes
        assert resumed - released >= weight_bytes
    finally:
        engine.shutdown()


def test_sglang_returns_the_routed_experts_of_every_token(tmp_path):
    """Rollout routing replay with SGLang (algorithm.routing_replay=rollout): our engine wrapper, started
    with enable_return_routed_experts, returns each generation's routing over the MoE layers, and it is what
    transformers' routers choose on one forward over the prompt and the response without its last token
    (fp32 on both sides; a near-tie may flip: 99% of (token, layer) expert sets must agree)."""
    pytest.importorskip("sglang", reason="SGLang is not installed in this environment")
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.hf import build_hf_model
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig

    cfg = ModelConfig(family="qwen3_moe", num_layers=4, num_experts=8, moe_ffn_hidden_size=64, moe_router_topk=2,
                      vocab_size=128)
    hf = build_hf_model(cfg, seed=0)
    hf.save_pretrained(tmp_path)
    load_tokenizer("builtin:char").save_pretrained(tmp_path)
    layout = (cfg.num_layers, tuple(range(cfg.num_layers)), cfg.moe_router_topk)
    engine = SGLangEngine(SGLangEngineConfig(model_path=str(tmp_path), dtype="float32", routing_layout=layout,
                                             mem_fraction_static=0.3,
                                             server_args={"enable_return_routed_experts": True}))
    prompts = [[5, 9, 2, 40], [7, 3, 11, 12, 13, 30, 31]]
    try:
        gens = engine.generate(prompts, SamplingParams(max_new_tokens=12, n=2, return_routing=True))
    finally:
        engine.shutdown()
    hf = hf.cuda().float()
    agree = total = 0
    for gen in gens:
        fed = prompts[gen.prompt_index] + gen.output_ids[:-1]
        seen = []
        handles = [layer.mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[2].cpu()))
                   for layer in hf.model.layers]
        with torch.no_grad():
            hf(torch.tensor([fed], device="cuda"))
        for handle in handles:
            handle.remove()
        expected = torch.stack(seen, dim=1).sort(-1).values
        assert gen.routing.shape == (len(fed), cfg.num_layers, cfg.moe_router_topk)
        same = (gen.routing.long().sort(-1).values == expected).all(-1)
        agree, total = agree + int(same.sum()), total + same.numel()
    print(f"SGLang routed experts: {agree}/{total} (token, layer) sets equal transformers'")
    assert agree >= 0.99 * total
