"""The hf engine's sampling against transformers itself: temperature 0 is greedy decoding (the argmax, as
`generate(do_sample=False)` gives it, no multinomial) with log-probs at temperature 1, as SGLang reports them;
sampled tokens carry log-probs at the sampling temperature. Each is checked by a teacher-forced forward of
the same weights in transformers."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config.schema import ModelConfig
from megatron_rl.models.hf import build_hf_model, hub_state_dict
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.hf_engine import HFEngine

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12]]


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig(num_layers=2)
    model = build_hf_model(cfg, seed=4).eval()
    engine = HFEngine(cfg)
    engine.update_weights(hub_state_dict(model).items(), version=1)
    return model, engine


def _teacher_forced(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def test_temperature_zero_is_greedy_with_logprobs_at_temperature_one(setup):
    model, engine = setup
    params = SamplingParams(temperature=0, max_new_tokens=12, n=2)
    assert params.greedy and params.logprob_temperature == 1.0
    gens = engine.generate(PROMPTS, params)
    assert len(gens) == 2 * len(PROMPTS)
    for gen in gens:
        prompt = PROMPTS[gen.prompt_index]
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  do_sample=False, max_new_tokens=12, eos_token_id=engine.eos_token_id,
                                  pad_token_id=engine.pad_token_id)[0, len(prompt):].tolist()
        assert gen.output_ids == want[:len(gen.output_ids)]
        got = torch.tensor(gen.logprobs)
        assert torch.allclose(got, _teacher_forced(model, prompt, gen.output_ids, 1.0), atol=1e-4)
    # the same prompt twice gives the same tokens: nothing was sampled
    first = [g.output_ids for g in gens if g.prompt_index == 0]
    assert first[0] == first[1]


def test_sampled_tokens_carry_logprobs_at_the_sampling_temperature(setup):
    model, engine = setup
    gens = engine.generate(PROMPTS, SamplingParams(temperature=0.7, max_new_tokens=12, n=2, seed=1))
    for gen in gens:
        want = _teacher_forced(model, PROMPTS[gen.prompt_index], gen.output_ids, 0.7)
        assert torch.allclose(torch.tensor(gen.logprobs), want, atol=1e-4)


def test_a_negative_temperature_is_refused():
    with pytest.raises(ValueError, match="must be >= 0"):
        SamplingParams(temperature=-0.1)
