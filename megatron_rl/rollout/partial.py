"""Partial rollouts: generate in chunks of a few tokens so that a weight update can be applied
while sequences are still unfinished; they then continue with the new weights.

Works with any `RolloutEngine` (token ids in, token ids out): the first chunk samples
`params.n` completions per prompt with `max_new_tokens = chunk_tokens`; each later chunk
sends every unfinished sequence back as a prompt (its prompt + what it generated so far,
`n=1`) for up to `chunk_tokens` more tokens. Between chunks `between_chunks()` runs; the
disaggregated generator applies a pending weight update there. Every token keeps the
log-prob and the weight version the engine reported when it sampled it, so a sequence that
spans an update carries per-token versions (`token_versions`), and the trainer's truncated
importance-sampling weight (old log-probs recomputed vs these rollout log-probs) corrects for
the mix. The hf engine prefills the continuation again; SGLang's radix cache would reuse the
prefix, but a weight update flushes it anyway.

With `chunk_tokens = 0` the request is one `generate` call (no update can land mid-sequence).

Rollout routing replay (`params.return_routing`): a continuation routes the whole sequence again,
maybe with newer weights; the sequence keeps, per position, the routing row of the call that
sampled the token that position predicts (`_extend_routing`), so the rows line up with
`token_versions` and the log-probs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from megatron_rl.rollout.base import Generation, SamplingParams


@dataclasses.dataclass
class PartialGeneration(Generation):
    """A `Generation` whose tokens may come from several weight versions (`weight_version`
    is that of its first token, the oldest)."""

    token_versions: list[int] = dataclasses.field(default_factory=list)  # one per output token


def generate_partial(engine: Any, prompts: Sequence[Sequence[int]], params: SamplingParams, chunk_tokens: int,
                     between_chunks: Callable[[], None] = lambda: None) -> list[PartialGeneration]:
    """`params.n` completions per prompt, ordered by prompt then sample, generated in chunks of
    `chunk_tokens` (0: one call) with `between_chunks()` called between engine calls."""
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 0 (0 generates in one call)")
    step = chunk_tokens or params.max_new_tokens
    first = dataclasses.replace(params, max_new_tokens=min(step, params.max_new_tokens))
    out = [_as_partial(g) for g in engine.generate([list(p) for p in prompts], first)]
    for chunk in range(1, -(-params.max_new_tokens // step)):
        todo = [i for i, g in enumerate(out) if g.finish_reason == "length"
                and len(g.output_ids) < params.max_new_tokens]
        if not todo:
            break
        between_chunks()
        budget = min(step, params.max_new_tokens - min(len(out[i].output_ids) for i in todo))
        seed = None if params.seed is None else params.seed * 1009 + chunk
        more = engine.generate([list(prompts[out[i].prompt_index]) + out[i].output_ids for i in todo],
                               dataclasses.replace(params, n=1, max_new_tokens=budget, seed=seed))
        for i, g in zip(todo, more):
            keep = params.max_new_tokens - len(out[i].output_ids)  # sequences may differ in length
            tokens, logprobs = g.output_ids[:keep], g.logprobs[:keep]
            out[i].output_ids += tokens
            out[i].logprobs += logprobs
            out[i].token_versions += [g.weight_version] * len(tokens)
            if params.return_routing:
                out[i].routing = _extend_routing(out[i], g, len(prompts[out[i].prompt_index]))
            stopped = g.finish_reason == "stop" and len(tokens) == len(g.output_ids)
            out[i].finish_reason = "stop" if stopped else g.finish_reason if g.finish_reason == "abort" else "length"
    return out


def _as_partial(g: Generation) -> PartialGeneration:
    return PartialGeneration(g.prompt_index, list(g.output_ids), list(g.logprobs), g.finish_reason,
                             g.weight_version, routing=g.routing, token_versions=[g.weight_version] * len(g.output_ids))


def _extend_routing(seq: PartialGeneration, more: Generation, prompt_len: int) -> torch.Tensor:
    """`seq`'s routing (its tokens already extended by `more`'s) for rollout routing replay: the rows it had,
    then `more`'s rows of the positions it adds. A continuation feeds the earlier tokens again with its own,
    maybe newer, weights; their rows stay those of the call that sampled the token each one predicts (row j
    routes the token at position j, whose logits give token j + 1), as `token_versions` and the log-probs do."""
    if seq.routing is None or more.routing is None:
        raise ValueError("return_routing: the engine returned a generation without its routing")
    rows = prompt_len + len(seq.output_ids) - 1
    if more.routing.shape[0] < rows:
        raise ValueError(f"return_routing: a continuation's routing has {more.routing.shape[0]} rows, fewer than "
                         f"the {rows} positions its sequence has fed")
    return torch.cat([seq.routing, more.routing[seq.routing.shape[0]:rows]])
