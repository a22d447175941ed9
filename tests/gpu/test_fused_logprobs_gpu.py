"""GPU checks for the fused log-prob kernel (run on a GPU machine: `pytest tests/gpu -q`;
skipped without CUDA or triton).

- The Triton block backend equals the PyTorch reference (`backend="torch"`) on CUDA: forward
  (log-probs, entropy) and backward (grad_hidden, grad_weight), fp32 and bf16, with a
  temperature and chunk sizes that do not divide T or V. Both compute the same block logits
  with the same GEMM, so the only differences are the order of the softmax reductions:
  tolerances 1e-5 on log-probs / entropies and 1e-4 relative on gradients (fp32), bf16 gradients
  within 2 bf16 ulps of the larger values (1e-2 relative).
- Peak CUDA memory at 8192 tokens x 150000 vocabulary x 4096 hidden in bf16, forward + backward:
  the fused path (auto backend) uses at most a quarter of the naive path's
  (torch.cuda.max_memory_allocated over the call), with equal log-probs.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on a GPU machine)", allow_module_level=True)
pytest.importorskip("triton", reason="needs triton for the Triton backend")

from megatron_rl_kernels import fused_logprobs, naive_logprobs, select  # noqa: E402


def _inputs(T, V, H, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen).to("cuda", dtype)
    weight = (torch.randn(V, H, generator=gen) * H ** -0.5).to("cuda", dtype)
    targets = torch.randint(0, V, (T,), generator=gen).cuda()
    return hidden, weight, targets, torch.randn(T, generator=gen).cuda(), torch.randn(T, generator=gen).cuda()


def _run(backend, hidden, weight, targets, g_lp, g_ent, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fused_logprobs(h, w, targets, backend=backend, with_entropy=True, **kw)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def test_auto_selects_triton_on_cuda():
    assert select(torch.device("cuda")) == "triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_triton_backend_equals_reference(dtype, temperature):
    args = _inputs(515, 5003, 256, dtype)
    kw = dict(temperature=temperature, chunk_tokens=200, chunk_vocab=1500)
    lp, ent, gh, gw = _run("triton", *args, **kw)
    lp_ref, ent_ref, gh_ref, gw_ref = _run("torch", *args, **kw)
    assert torch.allclose(lp, lp_ref, atol=1e-5), (lp - lp_ref).abs().max()
    assert torch.allclose(ent, ent_ref, atol=1e-5), (ent - ent_ref).abs().max()
    rel = 1e-4 if dtype == torch.float32 else 1e-2
    for got, want in ((gh, gh_ref), (gw, gw_ref)):
        scale = want.float().abs().max()
        assert (got.float() - want.float()).abs().max() <= rel * scale


def test_triton_backend_on_a_vocabulary_shard():
    """A weight shard whose rows start at vocab_start = 1000 (targets are full-vocabulary ids)."""
    hidden, weight, targets, _, _ = _inputs(300, 4000, 128, torch.float32, seed=1)
    shard = weight[1000:2500]
    local = torch.where((targets >= 1000) & (targets < 2500), targets, torch.full_like(targets, 1000))
    for backend in ("triton", "torch"):
        lp, _ = fused_logprobs(hidden, shard, local, vocab_start=1000, backend=backend)
        want, _ = naive_logprobs(hidden, shard, local - 1000)
        assert torch.allclose(lp, want, atol=1e-5)


def test_peak_memory_8k_tokens_150k_vocab_bf16():
    T, V, H = 8192, 150_000, 4096
    hidden, weight, targets, _, _ = _inputs(T, V, H, torch.bfloat16)
    peaks, results = {}, {}
    for name, fn in (("fused", fused_logprobs), ("naive", naive_logprobs)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        lp, ent = fn(h, w, targets, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - before
        results[name] = lp.detach()
        del h, w, lp, ent
        torch.cuda.empty_cache()
    print(f"peak bytes: fused {peaks['fused'] / 2**30:.2f} GiB, naive {peaks['naive'] / 2**30:.2f} GiB")
    assert peaks["fused"] * 4 <= peaks["naive"], peaks
    assert torch.allclose(results["fused"], results["naive"], atol=1e-3)
