"""The top-k log-prob kernels (`megatron_rl_kernels.topk_logprobs`, `logprobs_at`) on one process, against an
independent float64 computation: full [T, V] logits, `torch.log_softmax`, `torch.topk`, gather, and autograd for
the gradients. Tolerances as test_fused_logprobs.py's (fp32 kernels, O(5) logits): 2e-5 on log-probs, 1e-4 on
gradients. Chunks smaller than the batch make every path cross a chunk boundary."""

from __future__ import annotations

import pytest
import torch

from megatron_rl_kernels import logprobs_at, topk_logprobs


def _inputs(T=37, V=101, H=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    return hidden, weight, torch.randint(0, V, (T,), generator=g), g


def _reference(hidden, weight, temperature):
    return torch.log_softmax(hidden.double() @ weight.double().T / temperature, dim=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_tokens", [5, None])
def test_topk_matches_log_softmax_topk(temperature, chunk_tokens):
    hidden, weight, targets, _ = _inputs()
    target_lp, ids, lps = topk_logprobs(hidden, weight, targets, k=9, temperature=temperature,
                                        chunk_tokens=chunk_tokens)
    logp = _reference(hidden, weight, temperature)
    top = logp.topk(9, dim=-1)
    assert ids.dtype == torch.long and ids.shape == (37, 9)
    assert torch.equal(ids, top.indices)  # no two logits of this draw are within rounding of each other
    assert torch.allclose(lps.double(), top.values, atol=2e-5)
    assert torch.allclose(target_lp.double(), logp.gather(1, targets[:, None])[:, 0], atol=2e-5)
    assert (lps[:, :-1] >= lps[:, 1:]).all()  # most likely first


def test_topk_of_the_whole_vocabulary_and_vocab_limit():
    hidden, weight, targets, _ = _inputs(V=40)
    _, ids, lps = topk_logprobs(hidden, weight, targets, k=40)
    # k = V: every token once, and their probabilities sum to 1
    assert torch.equal(ids.sort(dim=-1).values, torch.arange(40).expand(37, 40))
    assert torch.allclose(lps.double().exp().sum(-1), torch.ones(37, dtype=torch.float64), atol=1e-5)
    # vocab_limit: tokens at or above it are never candidates, but keep their probability in the normaliser
    _, ids, lps = topk_logprobs(hidden, weight, targets, k=30, vocab_limit=30)
    logp = _reference(hidden, weight, 1.0)
    assert int(ids.max()) < 30
    assert torch.allclose(lps.double().exp().sum(-1), logp[:, :30].exp().sum(-1), atol=1e-5)
    assert (lps.double().exp().sum(-1) < 1 - 1e-3).all()  # the ten tokens above the limit hold the rest
    with pytest.raises(ValueError, match=r"k=31 must be in \[1, 30\]"):
        topk_logprobs(hidden, weight, targets, k=31, vocab_limit=30)
    with pytest.raises(ValueError, match=r"k=0 must be in"):
        topk_logprobs(hidden, weight, targets, k=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_tokens, chunk_vocab", [(4, 16), (None, 8192)])
def test_logprobs_at_and_its_gradient(temperature, chunk_tokens, chunk_vocab):
    hidden, weight, _, g = _inputs()
    ids = torch.randint(0, 101, (37, 6), generator=g)
    ids[:, 1] = ids[:, 0]  # the same token twice at a position: both entries get their own gradient
    upstream = torch.randn(37, 6, generator=g)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got = logprobs_at(h, w, ids, temperature=temperature, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab)
    (got * upstream).sum().backward()
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want = _reference(hd, wd, temperature).gather(1, ids)
    (want * upstream.double()).sum().backward()
    assert torch.allclose(got.detach().double(), want.detach(), atol=2e-5)
    assert torch.allclose(h.grad.double(), hd.grad, atol=1e-4)
    assert torch.allclose(w.grad.double(), wd.grad, atol=1e-4)


def test_logprobs_at_refuses_ids_outside_the_vocabulary_and_takes_no_tokens():
    hidden, weight, _, _ = _inputs()
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 101\)"):
        logprobs_at(hidden, weight, torch.full((37, 2), 101))
    with pytest.raises(ValueError, match=r"ids must be \[T, K\]"):
        logprobs_at(hidden, weight, torch.zeros(37, dtype=torch.long))
    h = hidden[:0].clone().requires_grad_()
    empty = logprobs_at(h, weight, torch.zeros(0, 3, dtype=torch.long))
    assert empty.shape == (0, 3)
    empty.sum().backward()  # in the graph: a rank without tokens still gives (zero) gradients
    assert h.grad is not None


_MEASURE = r"""
import json, re, sys, torch
from megatron_rl_kernels import logprobs_at, naive_logprobs_at

def status(key):
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024

T, V, H, K = 1024, 150000, 256, 65
g = torch.Generator().manual_seed(0)
hidden, weight = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g) * 0.05
ids, upstream = torch.randint(0, V, (T, K), generator=g), torch.randn(T, K, generator=g)
h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark starts again from the current RSS
fn = logprobs_at if sys.argv[1] == "fused" else naive_logprobs_at
(fn(h, w, ids) * upstream).sum().backward()
print(json.dumps({"extra_bytes": status("VmHWM") - before, "weight_bytes": weight.numel() * 4}))
"""


def _measure(path: str) -> dict:
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MEASURE, path], check=True, capture_output=True, text=True,
                         env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"}, cwd="/")
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_logprobs_at_memory_is_its_weight_gradient_and_blocks_not_the_logits():
    """1024 tokens x 150000 vocabulary x 256 hidden, fp32, 65 tokens per position, forward + backward, each path in
    a fresh process (peak resident set over the call, as test_fused_logprobs.py measures it). The materialising
    path holds [T, V] fp32 logits several times over (0.6 GB each); the chunked one holds the weight's gradient
    (what any path must return, 146 MB) and a few blocks: under a quarter of the naive peak, and under twice the
    weight's gradient (an fp32 copy of the whole gradient beside it would reach that)."""
    fused, naive = _measure("fused"), _measure("naive")
    assert fused["extra_bytes"] * 4 <= naive["extra_bytes"], (fused, naive)
    assert fused["extra_bytes"] < 2 * fused["weight_bytes"], fused
