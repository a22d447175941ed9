"""The fused log-prob kernel (`megatron_rl_kernels.fused_logprobs`, PyTorch reference on CPU).

Expected values come from an independent float64 computation: full [T, V] logits,
`torch.log_softmax`, gather, -sum p log p, and autograd for the gradients. The kernel works in
fp32 on fp32 inputs, so tolerances are fp32 rounding of the sums involved: logits here are
O(5), a log-sum-exp over V <= 101 terms loses ~1e-6, we allow 2e-5 on log-probs and entropies
and 1e-4 on gradients (sums over up to T * V terms of O(1)).

The memory test measures peak resident memory in a fresh subprocess per path: the kernel's
resident-set high-water mark (VmHWM in /proc/self/status, which sees torch's CPU allocations,
unlike tracemalloc), reset to the current RSS through /proc/self/clear_refs once the inputs
exist, minus that RSS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl_kernels import fused_logprobs, naive_logprobs, select

REPO = Path(__file__).resolve().parents[2]


def _inputs(T=37, V=101, H=24, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    targets = torch.randint(0, V, (T,), generator=g)
    grad_lp = torch.randn(T, generator=g)
    grad_ent = torch.randn(T, generator=g)
    return hidden, weight, targets, grad_lp, grad_ent


def _float64_reference(hidden, weight, targets, temperature, grad_lp, grad_ent):
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    logp = torch.log_softmax(h @ w.T / temperature, dim=-1)
    lp = logp.gather(1, targets[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    ((lp * grad_lp.double()).sum() + (ent * grad_ent.double()).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunks", [(8, 13), (37, 101), (5, 1000), (64, 7)])
def test_matches_float64_log_softmax_forward_and_backward(temperature, chunks):
    hidden, weight, targets, grad_lp, grad_ent = _inputs()
    want_lp, want_ent, want_gh, want_gw = _float64_reference(hidden, weight, targets, temperature, grad_lp, grad_ent)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fused_logprobs(h, w, targets, temperature=temperature, chunk_tokens=chunks[0],
                             chunk_vocab=chunks[1], with_entropy=True)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (37,)
    ((lp * grad_lp).sum() + (ent * grad_ent).sum()).backward()
    assert torch.allclose(lp.double(), want_lp, atol=2e-5), (lp - want_lp).abs().max()
    assert torch.allclose(ent.double(), want_ent, atol=2e-5), (ent - want_ent).abs().max()
    assert torch.allclose(h.grad.double(), want_gh, atol=1e-4), (h.grad - want_gh).abs().max()
    assert torch.allclose(w.grad.double(), want_gw, atol=1e-4), (w.grad - want_gw).abs().max()


def test_logprobs_only_gradient_and_no_entropy():
    hidden, weight, targets, grad_lp, _ = _inputs(seed=1)
    want_lp, _, want_gh, want_gw = _float64_reference(hidden, weight, targets, 1.0, grad_lp, torch.zeros(37))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fused_logprobs(h, w, targets, chunk_tokens=10, chunk_vocab=30)
    assert ent is None
    (lp * grad_lp).sum().backward()
    assert torch.allclose(lp.double(), want_lp, atol=2e-5)
    assert torch.allclose(h.grad.double(), want_gh, atol=1e-4)
    assert torch.allclose(w.grad.double(), want_gw, atol=1e-4)


def test_entropy_only_gradient():
    hidden, weight, targets, _, grad_ent = _inputs(seed=2)
    _, want_ent, want_gh, want_gw = _float64_reference(hidden, weight, targets, 1.0, torch.zeros(37), grad_ent)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    _, ent = fused_logprobs(h, w, targets, chunk_tokens=16, chunk_vocab=16, with_entropy=True)
    (ent * grad_ent).sum().backward()
    assert torch.allclose(h.grad.double(), want_gh, atol=1e-4)
    assert torch.allclose(w.grad.double(), want_gw, atol=1e-4)


def test_gradient_only_for_weight_when_hidden_is_frozen():
    hidden, weight, targets, grad_lp, _ = _inputs(seed=3)
    _, _, _, want_gw = _float64_reference(hidden, weight, targets, 1.0, grad_lp, torch.zeros(37))
    w = weight.clone().requires_grad_()
    lp, _ = fused_logprobs(hidden, w, targets, chunk_tokens=9, chunk_vocab=20)
    (lp * grad_lp).sum().backward()
    assert torch.allclose(w.grad.double(), want_gw, atol=1e-4)


def test_vocab_shards_combine_to_the_full_vocabulary():
    """Each shard's statistics, combined by hand with Megatron's rule (max, then rescaled sums),
    give the full-vocabulary result: the same algebra `_combine_over_group` runs over TP ranks
    (tests/distributed/test_fused_logprobs_tp.py runs the real all-reduces)."""
    from megatron_rl_kernels.fused_logprobs import TorchBlockOps, _combine_over_group, _merge

    hidden, weight, targets, *_ = _inputs(seed=4)
    want_lp, want_ent, *_ = _float64_reference(hidden, weight, targets, 1.0, torch.zeros(37), torch.zeros(37))
    ops = TorchBlockOps()
    parts = []
    for start, end in ((0, 40), (40, 101)):
        z = hidden @ weight[start:end].T
        parts.append(ops.stats(z, targets - start, 1.0, True))
    (m1, s1, b1, t1), (m2, s2, b2, t2) = parts
    m, s, b = _merge(m1, s1, b1, m2, s2, b2)
    assert _combine_over_group(m, s, b, t1 + t2, None)[0] is m  # no group: unchanged
    assert torch.allclose((t1 + t2 - m - s.log()).double(), want_lp, atol=2e-5)
    assert torch.allclose((s.log() - b / s).double(), want_ent, atol=2e-5)


def test_bfloat16_matches_the_naive_path_in_bfloat16():
    """bf16 inputs: the logits of each block are rounded to bf16 as the output layer's are, so
    the result is the naive bf16 path's (not the unrounded fp32 one, which differs by ~1e-2)."""
    hidden, weight, targets, grad_lp, grad_ent = _inputs(T=64, V=300, H=32, seed=5, dtype=torch.bfloat16)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fused_logprobs(h, w, targets, temperature=0.7, chunk_tokens=16, chunk_vocab=64, with_entropy=True)
    ((lp * grad_lp).sum() + (ent * grad_ent).sum()).backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp2, ent2 = naive_logprobs(h2, w2, targets, temperature=0.7, with_entropy=True)
    ((lp2 * grad_lp).sum() + (ent2 * grad_ent).sum()).backward()
    assert torch.allclose(lp, lp2, atol=1e-4), (lp - lp2).abs().max()
    assert torch.allclose(ent, ent2, atol=1e-4), (ent - ent2).abs().max()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    # The naive gradient is rounded to bf16 once per GEMM; ours accumulates chunks in fp32 first.
    scale = float(w2.grad.float().abs().max())
    assert (w.grad.float() - w2.grad.float()).abs().max() <= 1e-2 * scale
    assert (h.grad.float() - h2.grad.float()).abs().max() <= 1e-2 * float(h2.grad.float().abs().max())
    unrounded = fused_logprobs(hidden, weight, targets, temperature=0.7, logits_dtype=torch.float32)[0]
    assert (unrounded - lp2).abs().max() > 10 * (lp - lp2).abs().max()


def test_invalid_arguments_are_named():
    hidden, weight, targets, *_ = _inputs()
    with pytest.raises(ValueError, match="hidden \\[T, H\\] and weight \\[V, H\\]"):
        fused_logprobs(hidden, weight[:, :5], targets)
    with pytest.raises(ValueError, match="targets must be"):
        fused_logprobs(hidden, weight, targets[:5])
    with pytest.raises(ValueError, match="pass tp_group"):
        fused_logprobs(hidden, weight[:50], targets.clamp(min=60))
    with pytest.raises(ValueError, match="temperature"):
        fused_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        fused_logprobs(hidden, weight, targets, backend="triton")
    with pytest.raises(ValueError, match="auto, torch, triton"):
        fused_logprobs(hidden, weight, targets, backend="cuda")


def test_cpu_selects_the_pytorch_reference_and_never_imports_triton():
    assert select(torch.device("cpu")) == "torch"
    code = ("import sys, torch; from megatron_rl_kernels import fused_logprobs; "
            "fused_logprobs(torch.randn(4, 8), torch.randn(16, 8), torch.tensor([1, 2, 3, 4])); "
            "assert 'triton' not in sys.modules and 'megatron_rl_kernels.triton_logprobs' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


@pytest.mark.parametrize("where", ["elsewhere", "checkout"])
def test_installed_as_megatron_rl_kernels_and_never_shadows_kernels(tmp_path, where):
    """The package is `megatron_rl_kernels`; `kernels` is PyPI's name, and transformers >= 5.25 imports PyPI's
    `kernels` with every model (transformers.activations). Run from the checkout (its root first on sys.path,
    as `python -m megatron_rl.train` and the test suite have it), `kernels` must not be found in the checkout:
    a kernels/__init__.py there made every model fail to build with "cannot import name 'CUDAProperties' from
    'kernels'" (kernels/ is now no package; ours is kernels/megatron_rl_kernels/)."""
    code = ("import importlib.util, megatron_rl_kernels, transformers.activations; "
            "print(megatron_rl_kernels.__file__); spec = importlib.util.find_spec('kernels'); "
            "print(spec and spec.origin)")
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO if where == "checkout" else tmp_path,
                         capture_output=True, text=True).stdout.split("\n")
    assert Path(out[0]).resolve() == REPO / "kernels" / "megatron_rl_kernels" / "__init__.py"
    # not installed (None), a namespace portion (origin None), or PyPI's package: never a module of the checkout
    assert out[1] == "None" or not Path(out[1]).resolve().is_relative_to(REPO / "kernels"), out[1]


_INTERPRET = r"""
import torch
from megatron_rl_kernels.fused_logprobs import TorchBlockOps, _FusedLogprobs
from megatron_rl_kernels.triton_logprobs import TritonBlockOps
for temperature in (1.0, 0.7):
    for with_entropy in (True, False):
        g = torch.Generator().manual_seed(0)
        hidden, weight = torch.randn(37, 16, generator=g), torch.randn(101, 16, generator=g) * 0.5
        targets, g_lp, g_ent = torch.randint(0, 101, (37,), generator=g), torch.randn(37), torch.randn(37)
        outs = []
        for ops in (TritonBlockOps(), TorchBlockOps()):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            lp, ent = _FusedLogprobs.apply(h, w, targets, None, 0, temperature, 8, 13, with_entropy, torch.float32, ops)
            ((lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0)).backward()
            outs.append([lp.detach(), h.grad, w.grad] + ([ent.detach()] if with_entropy else []))
        for got, want in zip(*outs):
            assert torch.allclose(got, want, atol=2e-5), (temperature, with_entropy, (got - want).abs().max())
"""


def test_triton_kernels_in_the_interpreter_equal_the_reference():
    """The Triton block kernels run by Triton's CPU interpreter (fp32; the interpreter truncates
    fp32 -> bf16, so bf16 is left to tests/gpu)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("needs triton (pip install triton) for its CPU interpreter")
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, "-c", _INTERPRET], check=True, env=env, cwd="/")


_MEASURE = r"""
import json, sys, time, torch
from megatron_rl_kernels import fused_logprobs, naive_logprobs
path, T, V, H = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
g = torch.Generator().manual_seed(0)
hidden = torch.randn(T, H, generator=g).requires_grad_()
weight = (torch.randn(V, H, generator=g) * 0.1).requires_grad_()
targets = torch.randint(0, V, (T,), generator=g)
def status_kb(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
open("/proc/self/clear_refs", "w").write("5")  # high-water mark := current RSS
base = status_kb("VmRSS:")
start = time.perf_counter()
fn = fused_logprobs if path == "fused" else naive_logprobs
lp, ent = fn(hidden, weight, targets, with_entropy=True)
(lp.sum() + ent.sum()).backward()
seconds = time.perf_counter() - start
peak = status_kb("VmHWM:")
out = dict(extra_bytes=(peak - base) * 1024, seconds=seconds)
if path == "fused":  # for equality, the naive forward of every 8th token (rows are independent; every
    with torch.no_grad():  # token chunk and vocabulary block of the fused path holds some of them)
        ref_lp, ref_ent = naive_logprobs(hidden[::8], weight, targets[::8], with_entropy=True)
    out["lp_diff"] = float((lp.detach()[::8] - ref_lp).abs().max())
    out["ent_diff"] = float((ent.detach()[::8] - ref_ent).abs().max())
print(json.dumps(out))
"""


def _measure(path: str, T: int, V: int, H: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _MEASURE, path, str(T), str(V), str(H)], check=True,
                         capture_output=True, text=True, env=env, cwd="/").stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_peak_memory_8k_tokens_150k_vocab_is_at_most_a_quarter_of_naive():
    """T=8192, V=150000, H=64, fp32, forward + backward with entropy.

    The naive path at this size needs ~23 GB (its fp32 [T, V] logits alone are 4.9 GB and it
    holds ~4.7 such buffers), more than this shared 24 GiB machine can give a test. So:
    (1) a bound that needs no extrapolation: whatever else it does, the naive path holds the
        [T, V] fp32 logits, T*V*4 bytes; the fused path's measured peak is under a quarter of that;
    (2) the naive path's measured peak at T=512 and 1024 (same V, H), checked to grow linearly
        in T (every buffer it holds is [T, V]), scaled to T=8192: the fused peak is far below
        a quarter of that too.
    Equality at full size: fused log-probs and entropies of every 8th token (1024 rows spread over
    all of the fused path's token chunks) against the naive forward of those rows (softmax rows are
    independent, so that is the naive result), within 1e-4.
    """
    T, V, H = 8192, 150_000, 64
    fused = _measure("fused", T, V, H)
    naive_512 = _measure("naive", 512, V, H)
    naive_1024 = _measure("naive", 1024, V, H)
    logits_bytes = T * V * 4
    assert fused["extra_bytes"] * 4 <= logits_bytes, fused
    assert 1.8 <= naive_1024["extra_bytes"] / naive_512["extra_bytes"] <= 2.2, (naive_512, naive_1024)
    naive_extrapolated = naive_1024["extra_bytes"] * T / 1024
    assert fused["extra_bytes"] * 4 <= naive_extrapolated
    # Log-probs and entropies here are ~12 (log 150000) and sum 150000 terms in another order:
    # fp32 rounding reaches ~2e-5 (seen: entropy 1.9e-5), so 1e-4 (relative ~1e-5).
    assert fused["lp_diff"] < 1e-4 and fused["ent_diff"] < 1e-4, fused


def test_no_tokens_gives_empty_results_and_zero_gradients():
    """A context-parallel rank may hold no target of a row: empty outputs, not an error."""
    hidden = torch.randn(0, 24, requires_grad=True)
    weight = torch.randn(101, 24, requires_grad=True)
    lp, ent = fused_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,) and lp.dtype == torch.float32
    (lp.sum() + ent.sum()).backward()
    assert weight.grad is not None and torch.equal(weight.grad, torch.zeros_like(weight))
