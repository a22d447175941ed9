"""A sample whose eos (or stop token) is its last allowed token finished: SGLang calls it "length", because its
Req.check_finished (sglang/srt/managers/schedule_batch.py) tests max_new_tokens before the stop tokens; the adapter
reports "stop", as the hf engine does. Checked against a transport that answers as SGLang's check does (no SGLang
process), and through partial rollouts, which would otherwise continue such a sample past its eos."""

from __future__ import annotations

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.factory import sglang_engine_config
from megatron_rl.rollout.partial import generate_partial
from megatron_rl.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig
from tests.unit.test_rollout_factory import rl_config
from tests.unit.test_sglang_routing import offline_engine

EOS, STOP = 2, 9


class _Transport:
    """Answers every request with the tokens of `script` (one list per call) cut at max_new_tokens, finished
    as SGLang's check_finished decides: the length first, then eos and the request's stop_token_ids."""

    def __init__(self, script: list[list[int]]) -> None:
        self.script, self.calls = script, []

    def generate(self, input_ids, sampling_params, return_routed_experts=False, lora=None):
        tokens = self.script[len(self.calls)]
        self.calls.append(sampling_params)
        out = []
        for sp in sampling_params:
            stops = {EOS, *sp.get("stop_token_ids", ())}
            ids, reason = [], "length"
            for t in tokens[:sp["max_new_tokens"]]:
                ids.append(t)
                if len(ids) >= sp["max_new_tokens"]:
                    break
                if t in stops:
                    reason = "stop"
                    break
            out.append({"output_ids": ids, "meta_info": {"finish_reason": {"type": reason}, "weight_version": "1",
                                                         "output_token_logprobs": [[-0.5, t, None] for t in ids]}})
        return out


def _engine(script: list[list[int]], eos: tuple[int, ...] = (EOS,)) -> SGLangEngine:
    return offline_engine(SGLangEngineConfig(model_path="unused", eos_token_ids=eos), _Transport(script), 1)


def test_eos_or_stop_token_at_the_length_limit_is_a_stop():
    params = SamplingParams(max_new_tokens=3, stop_token_ids=(STOP,))
    cases = [([5, 6, EOS], "stop"), ([5, 6, STOP], "stop"), ([5, 6, 7], "length"), ([5, EOS, 7], "stop")]
    for tokens, want in cases:
        gen = _engine([tokens]).generate([[1]], params)[0]
        assert gen.finish_reason == want, (tokens, gen)
    # an engine told no eos keeps SGLang's word for it (a stop token of the request still counts)
    assert _engine([[5, 6, EOS]], eos=()).generate([[1]], params)[0].finish_reason == "length"


def test_partial_rollouts_do_not_continue_past_an_eos_at_a_chunk_boundary():
    engine = _engine([[11, 12, 13, EOS], [21, 22]])
    out = generate_partial(engine, [[5, 6, 7]], SamplingParams(max_new_tokens=8), chunk_tokens=4)
    assert out[0].output_ids == [11, 12, 13, EOS] and out[0].finish_reason == "stop"
    assert len(engine._transport.calls) == 1  # no continuation was asked for


def test_the_factory_gives_the_engine_the_tokenizers_eos():
    cfg = rl_config(backend="sglang")
    config = sglang_engine_config(cfg, device_type="cuda", model_path="/m", base_gpu_id=0, random_seed=0,
                                  eos_token_id=EOS)
    assert config.eos_token_ids == (EOS,)
    assert "eos_token_ids" not in config.engine_kwargs()  # ours, not a ServerArgs field
    attach = sglang_engine_config(rl_config(backend="sglang", base_url="http://h:1"), device_type="cuda",
                                  model_path=None, base_gpu_id=0, random_seed=0, eos_token_id=EOS)
    assert attach.eos_token_ids == (EOS,)
