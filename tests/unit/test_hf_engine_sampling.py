"""The hf engine's sampling against transformers itself: temperature 0 is greedy decoding (the argmax, as
`generate(do_sample=False)` gives it, no multinomial) with log-probs at temperature 1, as SGLang reports them;
sampled tokens carry log-probs at the sampling temperature. Each is checked by a teacher-forced forward of
the same weights in transformers. The engine draws tokens itself (keeping one log-prob per row and step, not
every step's logits), yet a seeded call gives exactly the tokens of transformers' own sampling."""

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


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.7, 20, 0.9)])
def test_seeded_sampling_draws_what_transformers_generate_draws(setup, temperature, top_k, top_p):
    """Same weights, same left-padded batch (each prompt n times, in order), same seed: plain
    `generate(do_sample=True)` with its own warpers picks the engine's tokens."""
    model, engine = setup
    n, new = 2, 10
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=new, n=n, seed=5)
    gens = engine.generate(PROMPTS, params)
    rows = [p for p in PROMPTS for _ in range(n)]
    width = max(map(len, rows))
    ids = torch.tensor([[engine.pad_token_id] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    torch.manual_seed(5)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, do_sample=True, temperature=temperature,
                              top_k=top_k if top_k > 0 else 0, top_p=top_p, max_new_tokens=new,
                              eos_token_id=engine.eos_token_id, pad_token_id=engine.pad_token_id)[:, width:]
    for gen, row in zip(gens, want, strict=True):
        assert gen.output_ids == row[:len(gen.output_ids)].tolist()
        assert len(gen.output_ids) == new or gen.output_ids[-1] == engine.eos_token_id
    assert len({tuple(g.output_ids) for g in gens}) > 1  # something was sampled


def test_no_step_keeps_the_full_vocabulary_logits(setup, monkeypatch):
    """generate is not asked to return every step's logits or scores (rows x steps x vocab)."""
    _, engine = setup
    seen = {}
    original = engine.model.generate

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.model, "generate", spy)
    gens = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=2))
    assert not any(seen.get(k) for k in ("output_logits", "output_scores", "return_dict_in_generate"))
    assert all(len(g.logprobs) == len(g.output_ids) for g in gens)


def test_rollout_max_batch_size_bounds_each_generate_call(setup, monkeypatch):
    """rollout.max_batch_size reaches the engine, which splits a larger call into calls of at most that many
    sequences; greedy outputs do not depend on the split."""
    from megatron_rl.config import load_config
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.rollout.factory import make_standalone_engine

    model, whole = setup
    cfg = load_config(["rollout.max_batch_size=2", "model.num_layers=2"], world_size=1)
    split = make_standalone_engine(cfg, load_tokenizer(cfg.model.tokenizer), device=torch.device("cpu"), index=0,
                                   work_dir=None)
    split.update_weights(hub_state_dict(model).items(), version=1)
    split.eos_token_id, split.pad_token_id = whole.eos_token_id, whole.pad_token_id
    sizes = []
    original = split.model.generate
    monkeypatch.setattr(split.model, "generate", lambda **kw: sizes.append(len(kw["input_ids"])) or original(**kw))
    params = SamplingParams(temperature=0, max_new_tokens=8, n=2)
    got = split.generate(PROMPTS, params)
    assert sizes == [2, 2, 2]
    assert [g.output_ids for g in got] == [g.output_ids for g in whole.generate(PROMPTS, params)]


@pytest.mark.parametrize("chunk", [7, 50, 64, 1000])
def test_the_chunked_log_prob_is_the_log_softmax(chunk):
    """The engine's per-step log-prob (a log-sum-exp over vocabulary blocks) equals log_softmax's entry, for a
    vocabulary that the blocks divide or not, at a temperature, with -inf entries (top-k's) among the scores."""
    from megatron_rl.rollout.hf_engine import chosen_logprobs

    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 50, generator=gen, dtype=torch.float32) * 4
    scores[0, :20] = float("-inf")
    tokens = torch.tensor([25, 3, 49, 0, 17])
    want = torch.log_softmax(scores.double() / 0.7, dim=-1).gather(-1, tokens[:, None])[:, 0]
    got = chosen_logprobs(scores, tokens, 0.7, chunk)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, rtol=0, atol=2e-6)
