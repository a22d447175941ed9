"""On-policy distillation without processes: the per-token estimator against a hand computation, its gradient
through the policy loss against the exact reverse KL's (autograd over an enumerated vocabulary), the step's
shaping of advantages (mixed, pure, lost samples), and the config checks on real teacher checkpoints (a
tokenizer that differs, a missing checkpoint, settings pure distillation refuses)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.algorithms import make_policy_loss_fn
from megatron_rl.algorithms.distill import distill_advantages
from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.schema import CHAR_TOKENIZER_DIR, ModelConfig
from megatron_rl.rollout.collect import Rollout
from megatron_rl.trainer.core import LossInputs

D = torch.float64
# A teacher of another size than the tiny student (tiny_qwen2: 4 layers, width 128): a 2-layer Llama, width 64
TEACHER_ARCH = ModelConfig(family="llama", num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                           num_query_groups=2, vocab_size=128, tie_word_embeddings=False, qkv_bias=False)


def save_teacher(path: Path, arch: ModelConfig = TEACHER_ARCH, seed: int = 3, sharpen: float = 1.0) -> Path:
    """An HF checkpoint of `arch` (transformers' own random init under `seed`) with the shipped character
    tokenizer's files; `sharpen` scales its output layer, so that its next-token distributions are far from
    uniform (a random model's are nearly uniform, and so nearly equal to any other random model's)."""
    from megatron_rl.models.hf import build_hf_model

    model = build_hf_model(arch, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(CHAR_TOKENIZER_DIR / name, path / name)
    return path


def test_estimator_by_hand():
    student = torch.tensor([-0.5, -2.0, -1.0, -3.0])
    teacher = torch.tensor([-1.5, -0.5, -4.0, -0.1])
    mask = torch.tensor([1, 1, 0, 1])  # token 2: tool output, not the student's
    advantages, kl = distill_advantages(student, teacher, mask, coef=0.5)
    assert kl.tolist() == pytest.approx([1.0, -1.5, 0.0, -2.9])  # (-0.5 + 1.5), (-2 + 0.5), masked, (-3 + 0.1)
    assert advantages.tolist() == pytest.approx([-0.5, 0.75, 0.0, 1.45])  # -0.5 * kl
    with pytest.raises(ValueError, match=r"coef=0 is invalid"):
        distill_advantages(student, teacher, mask, coef=0)
    with pytest.raises(ValueError, match=r"equal shapes.*student \(4,\), teacher \(3,\)"):
        distill_advantages(student, teacher[:3], mask, coef=1.0)


def test_expected_gradient_is_the_reverse_kl_gradient():
    """One position, a 6-token vocabulary: the policy loss on the distillation advantages, averaged over every
    token the student can sample weighted by its probability, has exactly the gradient of KL(pi_s || pi_t)
    computed by autograd from the two distributions (the score-function identity the estimator rests on)."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(6, generator=gen, dtype=D, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(6, generator=gen, dtype=D) * 2, -1)
    coef = 0.7
    loss_fn = make_policy_loss_fn(SimpleNamespace(policy_loss="ppo_clip", eps_clip=0.2, eps_clip_high=0.2,
                                                  kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0,
                                                  loss_agg_mode="token_mean"))
    student = torch.log_softmax(theta, -1)
    expected_grad = torch.zeros(6, dtype=D)
    for y in range(6):
        advantage, _ = distill_advantages(student[y].detach()[None], teacher[y][None], torch.ones(1), coef)
        logprob = student[y][None]
        inp = LossInputs(logprobs=logprob, entropy=None, loss_mask=torch.ones(1, dtype=D),
                         sample_ids=torch.zeros(1, dtype=torch.long), sample_num_tokens=torch.ones(1, dtype=D),
                         extras={"advantages": advantage.to(D), "old_logprobs": logprob.detach()},
                         num_tokens=1, num_samples=1)
        loss, _ = loss_fn(inp)
        (grad,) = torch.autograd.grad(loss, theta, retain_graph=True)
        expected_grad += student[y].exp().detach() * grad
    exact_kl = (student.exp() * (student - teacher)).sum()
    (kl_grad,) = torch.autograd.grad(coef * exact_kl, theta)
    assert torch.allclose(expected_grad, kl_grad, atol=1e-12), (expected_grad, kl_grad)
    assert kl_grad.abs().max() > 1e-2  # the two distributions differ: the check is not 0 == 0


def _shape(mode, rollouts, advantages, teacher):
    from megatron_rl.rl.distill import combine

    return combine(SimpleNamespace(mode=mode, coef=2.0), rollouts, advantages, teacher)


def test_shaping_adds_or_replaces_advantages_and_skips_lost_samples():
    rollouts = [Rollout(0, [1, 2], [7, 5], [-1.0, -2.0], "stop", 1), Rollout(0, [1, 2, 3], [8, 5, 6],
                [-0.5, -0.5, -0.5], "stop", 1), Rollout(1, [1], [9], [-1.0], "stop", 1, status="unscored")]
    # the teacher's log-probs of each scored sample's targets [L-1]: the prompt's first targets, then the response's
    teacher = {id(rollouts[0]): torch.tensor([-7.0, -2.0, -1.0]), id(rollouts[1]): torch.tensor([-7.0, -7.0, -0.5,
                                                                                                  -1.5, -0.25])}
    rl = [torch.tensor([1.0, 1.0]), torch.tensor([-1.0, -1.0, -1.0]), None]
    mixed, metrics = _shape("mixed", rollouts, rl, teacher)
    # kl: (1, -1) and (0, 1, -0.25); advantage gain -2 * kl
    assert mixed[0].tolist() == pytest.approx([1 - 2.0, 1 + 2.0])
    assert mixed[1].tolist() == pytest.approx([-1.0, -1 - 2.0, -1 + 0.5])
    assert mixed[2] is None
    assert metrics["distill/reverse_kl"] == pytest.approx((1 - 1 + 0 + 1 - 0.25) / 5)
    assert metrics["distill/teacher_logprob"] == pytest.approx((-2 - 1 - 0.5 - 1.5 - 0.25) / 5)
    pure, _ = _shape("pure", rollouts, rl, teacher)
    assert pure[0].tolist() == pytest.approx([-2.0, 2.0]) and pure[1].tolist() == pytest.approx([0.0, -2.0, 0.5])
    assert pure[2] is None


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return save_teacher(tmp_path_factory.mktemp("teacher") / "llama")


def _load(*overrides):
    return load_config(["model=tiny_qwen2", "task=arithmetic", "rollout=hf", *overrides], world_size=1)


def test_a_teacher_with_the_students_tokenizer_is_accepted_and_read(teacher_dir):
    from megatron_rl.config.teacher import teacher_model_config

    cfg = _load(f"algorithm.distill.teacher={teacher_dir}", "algorithm.distill.mode=pure", "algorithm.distill.coef=2")
    teacher = teacher_model_config(cfg.model, cfg.algorithm.distill.teacher)
    assert (teacher.family, teacher.num_layers, teacher.hidden_size) == ("llama", 2, 64)
    assert teacher.tokenizer == cfg.model.tokenizer and teacher.path == str(teacher_dir)


def test_a_teacher_with_another_vocabulary_is_refused(teacher_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(teacher_dir, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # two ids swapped: same size, other tokens
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=rf"algorithm.distill.teacher={other}: its tokenizer differs from the "
                                          r"student's .*'a' is id \d+ for the student, \d+ for the teacher"):
        _load(f"algorithm.distill.teacher={other}")
    (other / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"holds no readable tokenizer.json, so it cannot be checked"):
        _load(f"algorithm.distill.teacher={other}")


@pytest.mark.parametrize("override, message", [
    ("algorithm.filter_zero_variance=true", r"algorithm.filter_zero_variance=true drops samples by their rewards' "
                                            r"spread, but algorithm.distill.mode=pure"),
    ("algorithm.dynamic_sampling=true", r"algorithm.dynamic_sampling=true keeps groups"),
    ("rollout.temperature=0", r"rollout.temperature=0: the reverse KL is estimated from sampled tokens"),
    ("rollout.mode=disaggregated", r"rollout.mode=disaggregated: the teacher is implemented and tested for the "
                                   r"colocated rollout only"),
    ("mode=sft", r"distils on the student's own samples, which mode=sft does not draw"),
])
def test_settings_distillation_cannot_run_are_refused(teacher_dir, override, message):
    with pytest.raises(ConfigError, match=message):
        _load(f"algorithm.distill.teacher={teacher_dir}", "algorithm.distill.mode=pure", override)


def test_bad_distill_values_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm.distill.teacher=.*missing is not a directory"):
        _load(f"algorithm.distill.teacher={tmp_path / 'missing'}")
    with pytest.raises(ConfigError, match=r"algorithm.distill.coef=0 is invalid: must be > 0"):
        _load("algorithm.distill.coef=0")
    with pytest.raises(ConfigError, match=r"algorithm.distill.mode=forward is invalid: allowed values are mixed, pure"):
        _load("algorithm.distill.mode=forward")
    with pytest.raises(ConfigError, match=r"algorithm.distill.mode=pure is invalid: distils from a teacher"):
        _load("algorithm.distill.mode=pure")


SMOLLM2 = Path("/var/cache/megatron-rl/models/smollm2-135m")


def test_the_smollm2_recipe_composes_and_passes_the_checks_with_any_matching_teacher(teacher_dir):
    """Without the real checkpoint: the recipe's student is built on whatever tokenizer the teacher holds."""
    cfg = load_config(["+experiment=smollm2_distill", f"algorithm.distill.teacher={teacher_dir}"], world_size=1)
    assert cfg.model.tokenizer == str(teacher_dir) and cfg.model.path is None
    assert (cfg.model.family, cfg.model.num_layers, cfg.model.vocab_size) == ("llama", 6, 49152)


@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(),
                    reason=f"no SmolLM2-135M-Instruct at {SMOLLM2}: bash launch/get_model.sh smollm2-135m")
def test_the_smollm2_recipe_passes_every_check_with_the_real_teacher():
    from megatron_rl.config.teacher import teacher_model_config

    cfg = load_config(["+experiment=smollm2_distill", f"algorithm.distill.teacher={SMOLLM2}"], world_size=1)
    teacher = teacher_model_config(cfg.model, cfg.algorithm.distill.teacher)
    assert (teacher.family, teacher.num_layers, teacher.hidden_size) == ("llama", 30, 576)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.path) == (6, 192, None)  # a smaller student
    assert cfg.model.tokenizer == str(SMOLLM2) and cfg.algorithm.distill.mode == "pure"
