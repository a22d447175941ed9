"""Vocab-parallel entropy on one rank against torch's softmax entropy and its autograd gradient."""

import torch

from megatron_rl.trainer.logprobs import vocab_parallel_entropy


def test_entropy_and_gradient_match_autograd_reference():
    torch.manual_seed(0)
    logits = (torch.randn(5, 11, dtype=torch.float64) * 3).requires_grad_(True)
    weights = torch.randn(5, dtype=torch.float64)
    ours = vocab_parallel_entropy(logits, None)
    (ours * weights).sum().backward()
    grad_ours = logits.grad.clone()

    ref_logits = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(ref_logits, -1)
    ref = -(logp.exp() * logp).sum(-1)
    (ref * weights).sum().backward()
    assert torch.allclose(ours.double(), ref, atol=1e-6)
    assert torch.allclose(grad_ours, ref_logits.grad, atol=1e-6)


def test_uniform_logits_have_log_vocab_entropy():
    h = vocab_parallel_entropy(torch.zeros(2, 16), None)
    assert torch.allclose(h, torch.full((2,), float(torch.log(torch.tensor(16.0)))))
