"""Model rewards in the RL loop end to end on CPU (python -m megatron_rl.train, the hf engine, a tiny policy from
random init):

- a reward model trained in the test (plain torch, transformers' Qwen2ForSequenceClassification, 300 Adam steps)
  to prefer the answer `7` - its score is 4 x the share of `7` tokens in the sequence - is loaded into the job and
  its scores alone drive GRPO: within ten steps the policy's responses turn to `7` (counted in the decoded
  rollouts, independently of the reward model) and the training reward rises with them, as does the held-out
  reward (evaluation is scored by the same reward model);
- a joint run mixes a reward-model domain, a judged domain (the policy's engine judges: a random policy states no
  verdict, so its samples are unscored and counted, never scored 0) and a rule-verified domain, with per-domain
  calibration, and the reward-model domain's rule check counts its disagreements.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]


def train_reward_model(out: Path, steps: int = 300) -> Path:
    """A one-layer Qwen2 reward model whose score is 4 x the share of `7` tokens in its input."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.hf import hf_config

    tokenizer = load_tokenizer("builtin:char")
    seven = tokenizer("7", add_special_tokens=False)["input_ids"][0]
    config = hf_config(ModelConfig(family="qwen2", num_layers=1, hidden_size=64, ffn_hidden_size=128,
                                   num_attention_heads=2, num_query_groups=1, tie_word_embeddings=False))
    config.num_labels, config.pad_token_id = 1, 0
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        ids = torch.randint(4, 120, (32, 48), generator=gen)
        ids[torch.rand(32, 48, generator=gen) < torch.rand(32, 1, generator=gen) * 0.5] = seven
        loss = torch.nn.functional.mse_loss(model(input_ids=ids).logits[:, 0], (ids == seven).float().mean(1) * 4)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    final = float(loss.detach())
    assert final < 0.01, f"the reward model did not learn its target (loss {final:.4f})"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _train(run_dir: Path, *overrides: str) -> list[dict]:
    args = [sys.executable, "-m", "megatron_rl.train", "model=tiny_qwen2", f"run_dir={run_dir}",
            "logging.progress=false", "logging.dump_rollouts=true", "rollout.max_new_tokens=16", *overrides]
    proc = subprocess.run(args, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return train_reward_model(tmp_path_factory.mktemp("rm") / "sevens")


def _share_of_sevens(run_dir: Path, step: int) -> float:
    rows = [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step:08d}.jsonl").read_text().splitlines()]
    text = "".join(r["response_text"] for r in rows)
    return text.count("7") / max(len(text), 1)


def test_a_reward_model_moves_the_policy_toward_its_preferred_answer(tmp_path, reward_model):
    rows = _train(tmp_path / "run", "task=arithmetic", "task.reward=reward_model",
                  f"task.reward_model.path={reward_model}", "task.num_eval=8", "task.eval_every=10",
                  "task.eval_samples=2", "task.eval_temperature=1.0", "num_steps=10",
                  "global_batch_size=64", "rollout.n_samples_per_prompt=8", "optimizer.lr=5e-3")
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 10 and all(r["reward/model_scored"] == 64 for r in rows if "reward/mean" in r)
    # a random policy writes `7` about as often as any of its 128 tokens; the reward model's preference makes
    # it the policy's answer (observed: 0.2% of response characters at step 1, 58% at step 10)
    first, last = _share_of_sevens(tmp_path / "run", 1), _share_of_sevens(tmp_path / "run", 10)
    assert first < 0.03 and last > 0.2, (first, last)
    assert sum(rewards[-2:]) / 2 > 2 * sum(rewards[:2]) / 2, rewards
    # evaluation scores the held-out responses with the same reward model (observed: 0.068 at step 0, 0.545 after)
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert len(evals) == 2 and evals[1] > 2 * evals[0], evals


def test_a_joint_run_mixes_model_judge_and_rule_domains(tmp_path, reward_model):
    domains = ("+domains={rm:{task:{name:rm,type:arithmetic,reward:reward_model,rule_check:math,"
               f"reward_model:{{path:{reward_model}}},num_eval:0}}}},"
               "judged:{task:{name:judged,type:arithmetic,reward:judge,num_eval:0,judge:{show_reference:false}}},"
               "rule:{task:{name:rule,type:arithmetic,num_eval:0}}}")
    rows = _train(tmp_path / "joint", domains, "num_steps=2", "global_batch_size=48", "rollout.n_samples_per_prompt=4",
                  "task.num_eval=0", "algorithm.domain_calibration=running")
    trained = [r for r in rows if "reward/mean" in r]
    assert len(trained) == 2
    for r in trained:
        judged = r["reward/judge_calls"]
        # every judged sample of a random policy is unscored, none silently 0; every reward-model sample is scored
        assert judged > 0 and r["reward/judge_parse_failures"] == judged and r["reward/unscored"] >= judged
        assert r["reward/model_scored"] > 0 and r["reward/model_rule_checked"] == r["reward/model_scored"]
        assert 0 <= r["reward/model_rule_disagree"] <= r["reward/model_rule_checked"]
    rollouts = [json.loads(line) for line in (tmp_path / "joint" / "rollouts" / "step_00000001.jsonl").open()]
    by_domain = {d: [x for x in rollouts if x["domain"] == d] for d in ("rm", "judged", "rule")}
    assert all(by_domain.values()), {d: len(v) for d, v in by_domain.items()}
    assert all(x["status"] == "unscored" for x in by_domain["judged"])
    assert all("model_score" in x["checks"] and "rule_reward" in x["checks"] for x in by_domain["rm"])
    assert all(x["checks"] == {} for x in by_domain["rule"])
