"""GPU checks for the top-k log-prob kernels (`megatron_rl_kernels.topk_logprobs`, `logprobs_at`; run on a GPU
machine: `pytest tests/gpu -q`; skipped without CUDA). They are PyTorch code on any device; tests/unit covers them
on CPU against float64. Here, on CUDA:

- fp32: equal to the materialising references (`naive_topk_logprobs`, `naive_logprobs_at` with autograd) on the
  same device, chunk sizes that do not divide T: log-probs 1e-5, gradients 1e-4 relative to their largest value.
- bf16: the top k's log-probs equal the reference's sorted values within bf16 rounding of the logits (2e-2), and
  each returned id's log-prob is the reference's log-prob of that id (ties in bf16 logits may order ids
  differently); gradients within 2e-2 relative.
- Peak CUDA memory at 8192 tokens x 150000 vocabulary x 4096 hidden in bf16, `logprobs_at` of 65 tokens per position
  forward + backward: at most a quarter of the naive path's (torch.cuda.max_memory_allocated over the call).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on a GPU machine)", allow_module_level=True)

from megatron_rl_kernels import logprobs_at, naive_logprobs_at, naive_topk_logprobs, topk_logprobs  # noqa: E402


def _inputs(T, V, H, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen).to("cuda", dtype)
    weight = (torch.randn(V, H, generator=gen) * H ** -0.5 * 4).to("cuda", dtype)
    targets = torch.randint(0, V, (T,), generator=gen).cuda()
    return hidden, weight, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_equals_the_reference_on_cuda(dtype):
    hidden, weight, targets = _inputs(515, 5003, 256, dtype)
    lp, ids, lps = topk_logprobs(hidden, weight, targets, k=16, temperature=0.7, chunk_tokens=200)
    lp_ref, ids_ref, lps_ref = naive_topk_logprobs(hidden, weight, targets, k=16, temperature=0.7)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(lp, lp_ref, atol=atol), (lp - lp_ref).abs().max()
    assert torch.allclose(lps, lps_ref, atol=atol), (lps - lps_ref).abs().max()
    full = torch.log_softmax((hidden @ weight.T / 0.7).float(), dim=-1)
    assert torch.allclose(lps, full.gather(1, ids), atol=atol)
    if dtype == torch.float32:
        assert torch.equal(ids, ids_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_at_and_gradients_equal_the_reference_on_cuda(dtype):
    hidden, weight, _ = _inputs(515, 5003, 256, dtype)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 5003, (515, 17), generator=gen).cuda()
    upstream = torch.randn(515, 17, generator=gen).cuda()
    found = []
    for fn, kw in ((logprobs_at, dict(chunk_tokens=200)), (naive_logprobs_at, {})):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(h, w, ids, temperature=0.7, **kw)
        (out.float() * upstream).sum().backward()
        found.append((out.detach().float(), h.grad.float(), w.grad.float()))
    (out, gh, gw), (out_ref, gh_ref, gw_ref) = found
    atol, rel = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 2e-2)
    assert torch.allclose(out, out_ref, atol=atol), (out - out_ref).abs().max()
    for got, want in ((gh, gh_ref), (gw, gw_ref)):
        assert (got - want).abs().max() <= rel * want.abs().max()


def _peak(fn, hidden, weight, ids, upstream) -> int:
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    (fn(h, w, ids).float() * upstream).sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del h, w
    torch.cuda.empty_cache()
    return peak


def test_logprobs_at_memory_at_scale():
    hidden, weight, _ = _inputs(8192, 150000, 4096, torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 150000, (8192, 65), generator=gen).cuda()
    upstream = torch.randn(8192, 65, generator=gen).cuda()
    fused = _peak(logprobs_at, hidden, weight, ids, upstream)
    naive = _peak(naive_logprobs_at, hidden, weight, ids, upstream)
    print(f"logprobs_at peak {fused / 2**30:.2f} GiB, naive {naive / 2**30:.2f} GiB, ratio {fused / naive:.3f}")
    assert fused <= naive / 4
