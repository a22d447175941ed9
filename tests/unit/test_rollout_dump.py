"""Rollout dumps (megatron_rl/rollout/dump.py): a step's rollouts read back equal to what was written,
an engine's MoE routing included (rollout routing replay trains on it)."""

from __future__ import annotations

import json

import torch

from megatron_rl.rollout.collect import Rollout
from megatron_rl.rollout.dump import read_rollouts, write_rollouts
from megatron_rl.rollout.multiturn import Episode


def test_rollouts_and_their_routing_read_back_as_written(tmp_path):
    routing = torch.randint(0, 8, (5, 2, 3), dtype=torch.int16)  # [prompt 3 + response 3 - 1, layers, k]
    written = [Rollout(0, [4, 5, 6], [7, 8, 1], [-0.5, -1.25, -2.0], "stop", 3, reward=1.0, routing=routing),
               Rollout(0, [4, 5, 6], [9], [-0.75], "length", 3),
               Episode(1, [2, 3], [10, 11, 12], [-0.1, 0.0, -0.2], "stop", 2, model_mask=[1, 0, 1], num_turns=2)]
    path = write_rollouts(tmp_path, 7, written, decode=lambda ids: " ".join(map(str, ids)))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0]["routing"]["shape"] == [5, 2, 3] and rows[0]["response_text"] == "7 8 1"
    read = read_rollouts(tmp_path, 7)
    assert [type(r) for r in read] == [Rollout, Rollout, Episode]
    assert read[0].routing.dtype == torch.int16 and torch.equal(read[0].routing, routing)
    assert read[1].routing is None and read[2].model_mask == [1, 0, 1]
    for got, want in zip(read, written):
        for field in ("prompt_index", "prompt_tokens", "output_ids", "logprobs", "finish_reason", "weight_version",
                      "reward"):
            assert getattr(got, field) == getattr(want, field), field
    sample = read[0].sample({})  # the trainer's sample carries the routing per target
    assert torch.equal(sample.extras["routing"], routing.reshape(5, 6))
