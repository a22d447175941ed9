"""Discriminative reward models (`rl/reward_model.py`): a `*ForSequenceClassification` checkpoint written by
transformers (Qwen2 and Llama, num_labels=1, randomly initialised, fp32) loads into Megatron with its `score`
head, and the scores of samples of different lengths packed together into one micro-batch, some ending in the
pad token, equal transformers' on the same padded batch, at TP=1, TP=2 (with sequence parallelism: the head is
replicated over TP ranks) and PP=2 (the head on the last stage, the scores broadcast).
The judge (rollout/judging.py) shares its requests over data-parallel ranks and gathers every verdict.

Tolerance: fp32 on both sides, different kernels and reduction orders; the issue's bound is 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

PAD = 3
FAMILIES = {"qwen2": dict(family="qwen2", num_layers=2, tie_word_embeddings=False),
            "llama": dict(family="llama", num_layers=2, tie_word_embeddings=False, qkv_bias=False)}


def _sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    out = [[int(t) for t in torch.randint(4, 120, (n,), generator=gen)] for n in (17, 5, 30, 11)]
    out[1] += [PAD, PAD]  # ends in the pad token (e.g. an eos that is the pad): scored at the token before
    out[3][4] = PAD  # a pad token inside a sequence is an ordinary token before its last
    return out


def save_reward_model(root: Path, family: str, seed: int = 0) -> Path:
    """A randomly initialised `<Family>ForSequenceClassification` with num_labels=1, as transformers saves it,
    with the char tokenizer."""
    from transformers import AutoModelForSequenceClassification

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.hf import hf_config

    config = hf_config(ModelConfig(**FAMILIES[family]))
    config.num_labels, config.pad_token_id = 1, PAD
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        torch.nn.init.normal_(model.score.weight, std=0.5)  # scores of magnitude ~1, not ~0.02
    path = root / family
    model.save_pretrained(path)
    load_tokenizer("builtin:char").save_pretrained(path)
    return path


LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}  # (tp, pp)


def _worker(rank: int, world: int, root: str, layout: str, out: str) -> None:
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.rl.reward_model import RewardModel
    from megatron_rl.trainer.core import TrainerOptions

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    tp, pp = LAYOUTS[layout]
    groups = state.initialize(tp, pp, sequence_parallel=tp > 1)
    scores = {}
    for family in FAMILIES:
        # micro_batch_tokens fits all four samples in one row: they are packed together
        model = RewardModel(str(Path(root) / family), ModelConfig(), OptimizerConfig(), groups,
                            TrainerOptions(micro_batch_tokens=80))
        scores[family] = model.score(_sequences())
    if rank == 0:
        torch.save(scores, Path(out) / f"scores-{layout}.pt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    for family in FAMILIES:
        save_reward_model(root, family)
    return root


def _transformers_scores(path: Path) -> list[float]:
    """transformers' scores of the batch, right-padded with the pad token under an attention mask."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    seqs = _sequences()
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[:, 0].tolist()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_scores_match_transformers(checkpoints, tmp_path, layout):
    tp, pp = LAYOUTS[layout]
    run_spawned(_worker, tp * pp, str(checkpoints), layout, str(tmp_path))
    ours = torch.load(tmp_path / f"scores-{layout}.pt")
    for family in FAMILIES:
        expected = _transformers_scores(checkpoints / family)
        assert max(abs(e) for e in expected) > 0.1, "scores near 0 would compare nothing"
        assert ours[family] == pytest.approx(expected, abs=1e-4), family


def _judge_worker(rank: int, world: int, out: str) -> None:
    import types

    from megatron_rl.parallel import dist as mdist
    from tests.unit.test_model_rewards import judged_on

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    groups = types.SimpleNamespace(dp_size=world, dp_rank=rank, is_first_model_parallel_rank=True)
    _, seen, rollouts, stats = judged_on(groups, show_reference=True)
    torch.save({"rewards": [r.reward for r in rollouts], "seen": len(seen), "stats": stats},
               Path(out) / f"judge-{rank}.pt")


def test_judging_is_shared_over_data_parallel_ranks(tmp_path):
    """Two data-parallel ranks each judge half of the responses (3 of 6) and both end with every verdict."""
    run_spawned(_judge_worker, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"judge-{rank}.pt") for rank in range(2)]
    assert [r["seen"] for r in ranks] == [3, 3]
    for r in ranks:
        assert r["rewards"] == pytest.approx([0.8, 0.2] * 3)
        assert r["stats"]["reward/judge_calls"] == 6 and r["stats"]["reward/judge_parse_failures"] == 0
