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
from megatron_rl.algorithms.distill import DISTILL_MASK, TEACHER_LOGPROBS, distill_advantages, topk_reverse_kl
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


def _coarsened_kl(p: torch.Tensor, q: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """KL(p || q) of two distributions [V] lumped into the tokens `top` and one bucket for the others, by hand."""
    p_rest, q_rest = 1 - p[top].sum(), 1 - q[top].sum()
    return (p[top] * (p[top] / q[top]).log()).sum() + p_rest * (p_rest / q_rest).log()


def test_topk_reverse_kl_by_hand_and_against_the_full_kl():
    """The top-k KL against the coarsened KL computed from the two whole distributions (V = 12, k = 4), below the
    full KL; with k = V it is the full KL, and its gradient in the student's logits is autograd's of the full KL."""
    gen = torch.Generator().manual_seed(1)
    theta = torch.randn(3, 12, generator=gen, dtype=D, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(3, 12, generator=gen, dtype=D) * 2, -1)
    student = torch.log_softmax(theta, -1)
    top = teacher.topk(4, dim=-1).indices
    got = topk_reverse_kl(student.gather(1, top), teacher.gather(1, top))
    full = (student.exp() * (student - teacher)).sum(-1)
    for t in range(3):
        want = _coarsened_kl(student[t].exp(), teacher[t].exp(), top[t])
        assert float(got[t].detach()) == pytest.approx(float(want.detach()), rel=1e-5)  # float32 against float64
        assert float(got[t].detach()) < float(full[t].detach())  # coarsening loses information: a lower bound
    assert float(full.detach().min()) > 0.3  # the distributions differ: the comparisons above are not of zeros
    everything = torch.arange(12).expand(3, 12)
    whole = topk_reverse_kl(student.gather(1, everything), teacher.gather(1, everything), whole_vocabulary=True)
    # without the flag, both tails are rounding noise below TAIL_FLOOR: the rest term is exactly 0 (no gradient)
    floored = topk_reverse_kl(student.gather(1, everything), teacher.gather(1, everything))
    assert torch.allclose(whole.double(), full, atol=1e-6) and torch.allclose(floored.double(), full, atol=1e-6)
    (got_grad,) = torch.autograd.grad(floored.sum(), theta, retain_graph=True)
    (want_grad,) = torch.autograd.grad(full.sum(), theta, retain_graph=True)
    assert torch.allclose(got_grad.double(), want_grad, atol=1e-6) and want_grad.abs().max() > 1e-2
    # a student whose mass lies outside the teacher's top k is pushed into it: its tail term has a gradient
    (tail_grad,) = torch.autograd.grad(got.sum(), theta)
    outside = torch.ones(3, 12, dtype=torch.bool).scatter(1, top, False)
    assert (tail_grad[outside] > 0).all()  # descent lowers every logit outside the top k (p_rest > q_rest here)
    with pytest.raises(ValueError, match=r"equal \[T, k\] shapes"):
        topk_reverse_kl(student[:, :4], teacher[:, :3])


def _topk_loss_fn(coef=1.5):
    distill = SimpleNamespace(teacher="/teacher", estimator="topk", coef=coef)
    return make_policy_loss_fn(SimpleNamespace(policy_loss="ppo_clip", eps_clip=0.2, eps_clip_high=0.2, kl_coef=0.0,
                                               kl_estimator="k3", entropy_coef=0.0, loss_agg_mode="token_mean",
                                               distill=distill))


def test_the_policy_loss_adds_the_topk_term_on_the_students_tokens():
    """loss = pg_loss + coef * token_mean(KL_t * distill_mask) over the global batch's loss tokens: tool output
    (mask 0) and the prompt (loss mask 0) add nothing; with zero advantages (mode=pure) pg_loss is 0."""
    gen = torch.Generator().manual_seed(2)
    student = torch.log_softmax(torch.randn(5, 10, generator=gen, dtype=D), -1)
    teacher = torch.log_softmax(torch.randn(5, 10, generator=gen, dtype=D) * 2, -1)
    top = teacher.topk(3, dim=-1).indices
    loss_mask = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0], dtype=D)  # target 0: the prompt's
    distill_mask = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0], dtype=D)  # target 2: tool output
    logprobs = student.gather(1, torch.arange(5)[:, None])[:, 0]
    inp = LossInputs(logprobs=logprobs, entropy=None, loss_mask=loss_mask, sample_ids=torch.zeros(5, dtype=torch.long),
                     sample_num_tokens=torch.full((5,), 4.0, dtype=D),
                     extras={"advantages": torch.zeros(5, dtype=D), "old_logprobs": logprobs,
                             TEACHER_LOGPROBS: teacher.gather(1, top), DISTILL_MASK: distill_mask},
                     num_tokens=8, num_samples=2, support_logprobs=student.gather(1, top))
    loss, metrics = _topk_loss_fn(coef=1.5)(inp)
    by_hand = sum(float(_coarsened_kl(student[t].exp(), teacher[t].exp(), top[t])) for t in (1, 3, 4)) / 8
    assert float(metrics["pg_loss"]) == 0.0
    assert float(metrics["distill_topk_kl"]) == pytest.approx(by_hand, rel=1e-5)
    assert float(loss) == pytest.approx(1.5 * by_hand, rel=1e-5)
    missing = dict(inp.extras)
    del missing[DISTILL_MASK]
    with pytest.raises(ValueError, match=r"needs extras \['distill_mask'\]"):
        _topk_loss_fn()(LossInputs(**{**inp.__dict__, "extras": missing}))
    with pytest.raises(ValueError, match=r"needs the teacher's top-k tokens in the samples"):
        _topk_loss_fn()(LossInputs(**{**inp.__dict__, "support_logprobs": None}))
    sampled = make_policy_loss_fn(SimpleNamespace(policy_loss="ppo_clip", eps_clip=0.2, eps_clip_high=0.2, kl_coef=0.0,
                                                  kl_estimator="k3", entropy_coef=0.0, loss_agg_mode="token_mean"))
    with pytest.raises(ValueError, match=r"carry a teacher's top-k tokens, but algorithm.distill.estimator is not"):
        sampled(inp)


def test_topk_shaping_gives_the_samples_the_teachers_tokens():
    """estimator=topk: pure zeroes the advantages, mixed keeps the RL ones; every scored sample carries the teacher's
    ids and log-probs [L-1, k] and the student-token mask [L-1]; a lost one carries nothing; the sampled-token KL
    is still reported, and the top-k mass is the mean over the student's tokens."""
    from megatron_rl.rl.distill import distill_shaping
    from megatron_rl.trainer.core import SUPPORT_IDS

    rollouts = [Rollout(0, [1, 2], [7, 5], [-1.0, -2.0], "stop", 1),
                Rollout(1, [1], [9], [-1.0], "stop", 1, status="unscored")]
    rollouts[0].model_mask = [1, 0]  # the second response token is tool output
    k = 2
    ids = torch.tensor([[3, 4], [7, 1], [5, 2]])
    lps = torch.log(torch.tensor([[0.5, 0.2], [0.6, 0.3], [0.1, 0.05]]))
    teacher_lp = torch.tensor([-7.0, -2.0, -1.0])

    class FakeTeacher:
        def score_topk(self, samples, topk, vocab_limit):
            assert (topk, vocab_limit, len(samples)) == (k, 128, 1)
            return [(teacher_lp, ids, lps)]

    rl = [torch.tensor([1.0, -1.0]), None]
    for mode in ("pure", "mixed"):
        cfg = SimpleNamespace(algorithm=SimpleNamespace(distill=SimpleNamespace(mode=mode, coef=2.0, estimator="topk",
                                                                                topk=k)),
                              model=SimpleNamespace(vocab_size=128))
        out, extras, metrics = distill_shaping(cfg, SimpleNamespace(teacher=FakeTeacher()), rollouts, rl)
        assert out[0].tolist() == ([0.0, 0.0] if mode == "pure" else [1.0, -1.0]) and out[1] is None
        assert torch.equal(extras[0][SUPPORT_IDS], ids) and torch.equal(extras[0][TEACHER_LOGPROBS], lps)
        assert extras[0][DISTILL_MASK].tolist() == [0.0, 1.0, 0.0] and extras[1] == {}
        assert metrics["distill/teacher_topk_mass"] == pytest.approx(0.9)  # target 1 only: 0.6 + 0.3
        assert metrics["distill/reverse_kl"] == pytest.approx(-1.0 + 2.0)  # the student's token: -1 - (-2)
        assert metrics["time/teacher"] >= 0


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
    with pytest.raises(ConfigError, match=r"algorithm.distill.estimator=full is invalid: allowed values are sampled, "
                                          r"topk"):
        _load("algorithm.distill.estimator=full")
    with pytest.raises(ConfigError, match=r"algorithm.distill.topk=0 is invalid"):
        _load("algorithm.distill.topk=0")


def test_topk_settings_it_cannot_run_are_refused(teacher_dir):
    base = (f"algorithm.distill.teacher={teacher_dir}", "algorithm.distill.estimator=topk")
    with pytest.raises(ConfigError, match=r"algorithm.distill.topk=129 is more tokens than the student's vocabulary "
                                          r"\(model.vocab_size=128\): at most 128"):
        _load(*base, "algorithm.distill.topk=129")
    with pytest.raises(ConfigError, match=r"estimator=topk takes the student's log-probs .* set "
                                          r"model.fused_logprobs=true"):
        _load(*base, "model.fused_logprobs=false")
    assert _load(*base, "algorithm.distill.topk=128").algorithm.distill.topk == 128  # the whole vocabulary


def test_topk_beyond_a_smaller_teachers_vocabulary_is_refused(tmp_path):
    """A teacher whose vocabulary covers the tokenizer (99 tokens) but not the student's 128 rows: k up to its own
    size runs, more is refused before the run rather than at the first step's top-k."""
    import dataclasses

    small = save_teacher(tmp_path / "small", arch=dataclasses.replace(TEACHER_ARCH, vocab_size=100))
    base = (f"algorithm.distill.teacher={small}", "algorithm.distill.estimator=topk")
    assert _load(*base, "algorithm.distill.topk=100").algorithm.distill.topk == 100
    with pytest.raises(ConfigError, match=r"algorithm.distill.topk=101 is more tokens than the teacher's vocabulary "
                                          r"\(100, algorithm.distill.teacher=.*\): at most 100"):
        _load(*base, "algorithm.distill.topk=101")


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
    assert (cfg.algorithm.distill.estimator, cfg.algorithm.distill.topk) == ("topk", 64)


def _episode():
    """A two-turn episode: prompt [1, 2], response [7, 5, 6] of which 5 is tool output (model_mask 0)."""
    from megatron_rl.rollout.multiturn import Episode

    return Episode(0, [1, 2], [7, 5, 6], [-1.0, 0.0, -0.5], "stop", 1, model_mask=[1, 0, 1])


def _only_at_the_loss_mask(sample, values):
    """What the trainer's forwards give with loss_targets_only (and forward_topk): NaN off the loss mask."""
    mask = sample.loss_mask.bool().reshape(-1, *[1] * (values.dim() - 1))
    return torch.where(mask, values, torch.full_like(values, float("nan")))


@pytest.mark.parametrize("estimator", ["sampled", "topk"])
def test_the_teachers_nan_off_the_models_tokens_is_never_read(estimator):
    """The teacher computes an episode's model tokens only (its sample's loss mask): NaN on the prompt and on tool
    output. Shaping reads nothing else: the advantages and metrics are those of the model's tokens, by hand."""
    from megatron_rl.rl.distill import distill_shaping

    episode = _episode()
    full_lp = torch.tensor([-9.0, -2.0, -3.0, -1.5])  # targets: 2 (prompt), 7, 5 (tool), 6
    ids = torch.tensor([[3, 4], [7, 1], [5, 2], [6, 0]])
    lps = torch.log(torch.tensor([[0.5, 0.2], [0.6, 0.3], [0.1, 0.05], [0.7, 0.1]]))

    class Teacher:
        def score(self, samples):
            return [_only_at_the_loss_mask(s, full_lp) for s in samples]

        def score_topk(self, samples, topk, vocab_limit):
            (s,) = samples
            return [(_only_at_the_loss_mask(s, full_lp), torch.where(s.loss_mask.bool()[:, None], ids, 0),
                     _only_at_the_loss_mask(s, lps))]

    assert torch.isnan(Teacher().score([episode.sample({})])[0][[0, 2]]).all()  # the real trainer's contract
    cfg = SimpleNamespace(algorithm=SimpleNamespace(distill=SimpleNamespace(mode="mixed", coef=2.0,
                                                                            estimator=estimator, topk=2)),
                          model=SimpleNamespace(vocab_size=128))
    rl = [torch.tensor([1.0, 1.0, 1.0])]
    out, extras, metrics = distill_shaping(cfg, SimpleNamespace(teacher=Teacher()), [episode], rl)
    # kl on the model's tokens: 7: -1 - (-2) = 1; 6: -0.5 - (-1.5) = 1; the tool output's 0
    assert metrics["distill/reverse_kl"] == pytest.approx((1.0 + 1.0) / 2)
    assert metrics["distill/teacher_logprob"] == pytest.approx((-2.0 - 1.5) / 2)
    if estimator == "sampled":
        assert out[0].tolist() == pytest.approx([1.0 - 2.0, 1.0, 1.0 - 2.0])
    else:
        assert out[0].tolist() == [1.0, 1.0, 1.0]  # mixed: the RL advantages; the KL term is the loss's
        assert metrics["distill/teacher_topk_mass"] == pytest.approx((0.9 + 0.8) / 2)
        assert extras[0][DISTILL_MASK].tolist() == [0.0, 1.0, 0.0, 1.0]


def test_the_kl_in_the_reward_reads_the_models_tokens_only():
    """kl_in_reward: the old and reference log-probs are the loss mask's only (NaN on tool output and prompt, as the
    trainer gives them); each token's penalty is kl_coef * (old - ref) on the model's tokens (k1), 0 on tool output."""
    from megatron_rl.rl.advantages import reward_kl

    episode = _episode()
    old = torch.tensor([-9.0, -1.0, -3.0, -0.5])
    ref = torch.tensor([-8.0, -1.5, -2.0, -1.5])

    class Trainer:
        weights = "policy"

        def forward_logprobs(self, samples, loss_targets_only=False, **_):
            assert loss_targets_only
            return [_only_at_the_loss_mask(s, old if self.weights == "policy" else ref) for s in samples], None

        def swap_weights(self, weights):
            current, self.weights = self.weights, weights
            return current

    seen = []
    run = SimpleNamespace(trainer=Trainer(), reference="reference",
                          kl_ctl=SimpleNamespace(coef=0.1, update=lambda kl, n: seen.append((kl, n))))
    cfg = SimpleNamespace(algorithm=SimpleNamespace(old_logprobs="recompute", routing_replay="none", kl_coef=0.1,
                                                    kl_estimator="k1", kl_clamp=None))
    found, metrics = reward_kl(cfg, run, [episode])
    assert found[0]["penalty"].tolist() == pytest.approx([0.1 * 0.5, 0.0, 0.1 * 1.0])
    assert metrics["kl_reward/kl"] == pytest.approx((0.5 + 1.0) / 2) and seen == [(pytest.approx(0.75), 1)]


def test_a_teacher_whose_context_the_samples_outrun_is_refused(tmp_path):
    """The teacher scores every position of every sample: a response as long as its context (32 positions in its
    config.json) would put its RoPE on positions it never trained on, silently; the student's context is 512."""
    import dataclasses
    import types

    from megatron_rl.rl.state import check_sample_budget

    short = save_teacher(tmp_path / "short", arch=dataclasses.replace(TEACHER_ARCH, max_position_embeddings=32))
    with pytest.raises(ConfigError, match=rf"algorithm.distill.teacher={short}: rollout.max_new_tokens=32 does not "
                                          r"fit the teacher's context \(32\)"):
        _load(f"algorithm.distill.teacher={short}", "rollout.max_new_tokens=32")
    assert _load(f"algorithm.distill.teacher={short}", "rollout.max_new_tokens=31").rollout.max_new_tokens == 31
    # the prompts' lengths are known once they are read: 20 + 16 > 32
    prompts = [types.SimpleNamespace(tokens=[1] * n) for n in (5, 20)]
    cfg = types.SimpleNamespace(rollout=types.SimpleNamespace(max_new_tokens=16), micro_batch_tokens=64,
                                model=types.SimpleNamespace(context_length=512))
    check_sample_budget(cfg, prompts)
    check_sample_budget(cfg, prompts, teacher_context=36)
    with pytest.raises(ValueError, match=r"longest training prompt has 20 tokens.*36 tokens, more than the "
                                         r"distillation teacher's context .*=32"):
        check_sample_budget(cfg, prompts, teacher_context=32)
