"""GPU checks for colocation (run on a GPU machine: `pytest tests/gpu -q`; skipped elsewhere).

- Trainer offload/onload really moves memory: allocated GPU memory drops by at least the
  parameter + gradient + optimizer bytes after `offload()` and returns after `onload()`;
  prints offload/onload GB/s.
- The hf engine's release/resume frees and re-allocates its weights on the GPU.
- With SGLang installed: `release_memory_occupation` drops GPU memory in use (seen from
  torch.cuda.mem_get_info, which includes other processes) and `resume` brings it back.
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
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    device = mdist.resolve_device("cuda")
    mdist.init_distributed(mdist.dist_env_from({}), device)
    groups = state.initialize(1, 1, device=device)
    cfg = ModelConfig(num_layers=24, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16,
                      num_query_groups=4, vocab_size=32768)
    t = Trainer(cfg, OptimizerConfig(), groups, TrainerOptions(micro_batch_tokens=4096))
    t.initialize_weights()
    from megatron_rl.trainer.packing import Sample

    t.train_step([Sample(torch.arange(1, 200), torch.ones(198)) for _ in range(4)])  # optimizer state exists
    return t


def test_trainer_offload_and_onload_move_memory(trainer):
    plan = trainer.memory_plan()
    expected = sum(plan.values())
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
    print(f"offload {moved_out / 1e9:.2f} GB in {offload_s:.3f}s ({moved_out / offload_s / 1e9:.1f} GB/s); "
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
