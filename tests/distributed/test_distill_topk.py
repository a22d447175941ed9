"""Top-k distillation through the trainer (gloo): the teacher's top-k tokens (Teacher.score_topk) equal
transformers' log_softmax top-k of the same checkpoint, restricted to the student's vocabulary, on one rank and at
tp=2, pp=2, cp=2 and dp=2 (each layout's own gathers: vocabulary shards, the last stage's results broadcast, a row's
targets split over context-parallel ranks, samples split over data-parallel ranks), at the samples' loss-mask
targets (the prompt's hold NaN: not computed). Then the student's update with the top-k term (pure distillation,
zero advantages) at the same layouts: its reported KL equals the one computed from transformers' forward of the
same student weights with `topk_reverse_kl` (the kernels under test never touch that side), and every layout
gives the same loss, gradient norm and weights after one Adam step as one rank.

Tolerances (fp32): log-probs 1e-4 against transformers (test_distill_teacher.py's); the KL 1e-4 relative; across
layouts only summation order differs: loss and grad norm 1e-5 relative, weights 5e-5 after one Adam step at lr 1e-3
(test_fused_logprobs_tp.py's reasoning)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_spawned
from tests.unit.test_distill import save_teacher

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
K, LIMIT, TEMPERATURE = 6, 100, 0.8
LAYOUTS = {"tp2": dict(tp=2, pp=1, cp=1), "pp2": dict(tp=1, pp=2, cp=1), "cp2": dict(tp=1, pp=1, cp=2),
           "dp2": dict(tp=1, pp=1, cp=1)}


def _sequences() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 99, (n,), generator=gen) for n in (12, 7, 20, 9)]


def _samples(extras=None):
    from megatron_rl.trainer.packing import Sample

    out = []
    for i, seq in enumerate(_sequences()):
        mask = torch.ones(len(seq) - 1)
        mask[:3] = 0.0  # a prompt of 4 tokens
        out.append(Sample(seq, mask, {} if extras is None else extras[i]))
    return out


def _loss_fn():
    from types import SimpleNamespace

    from megatron_rl.algorithms import make_policy_loss_fn

    distill = SimpleNamespace(teacher="/teacher", estimator="topk", coef=1.0)
    return make_policy_loss_fn(SimpleNamespace(policy_loss="ppo_clip", eps_clip=0.2, eps_clip_high=0.2, kl_coef=0.0,
                                               kl_estimator="k3", entropy_coef=0.0, loss_agg_mode="token_mean",
                                               distill=distill))


def _worker(rank: int, world: int, path: str, layouts: dict, out: str) -> None:
    from megatron_rl.algorithms.distill import DISTILL_MASK, TEACHER_LOGPROBS
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.config.teacher import teacher_model_config
    from megatron_rl.models.hf import random_state_dict
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import SUPPORT_IDS, Trainer, TrainerOptions
    from megatron_rl.trainer.teacher import Teacher

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    student = ModelConfig()  # tiny_qwen2, vocabulary 128
    options = TrainerOptions(micro_batch_tokens=32, logprob_temperature=TEMPERATURE)
    found = {}
    for name, layout in layouts.items():
        groups = state.initialize(layout["tp"], layout["pp"], layout["cp"])
        teacher = Teacher(teacher_model_config(student, path), OptimizerConfig(), groups, options)
        scored = teacher.score_topk(_samples(), K, vocab_limit=LIMIT)
        extras = [{SUPPORT_IDS: ids, TEACHER_LOGPROBS: lps, DISTILL_MASK: torch.ones(len(lp)),
                   "advantages": torch.zeros(len(lp)), "old_logprobs": lp} for lp, ids, lps in scored]
        trainer = Trainer(student, OptimizerConfig(lr=1e-3, clip_grad=1.0), groups, options)
        trainer.load_full_state_dict(random_state_dict(student, seed=3))
        metrics = trainer.train_step(_samples(extras), _loss_fn())
        found[name] = dict(scored=scored, metrics=metrics, weights=trainer.full_state_dict())
        if name == "single":  # a critic (mixed mode with GAE) trains on the same samples: it ignores the top k
            from megatron_rl.algorithms.objective import make_value_loss_fn

            critic = Trainer(student, OptimizerConfig(lr=1e-3), groups, options, head="value")
            for x in extras:
                x.update(returns=torch.ones(len(x["advantages"])), old_values=torch.zeros(len(x["advantages"])))
            found[name]["critic"] = critic.train_step(_samples(extras), make_value_loss_fn(None))
        state.destroy()
    if rank == 0:
        torch.save(found, out)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_topk")
    path = save_teacher(root / "teacher", sharpen=4.0)
    run_spawned(_worker, 1, str(path), {"single": dict(tp=1, pp=1, cp=1)}, str(root / "single.pt"), timeout_s=500)
    run_spawned(_worker, 2, str(path), LAYOUTS, str(root / "pair.pt"), timeout_s=800)
    return path, {**torch.load(root / "single.pt"), **torch.load(root / "pair.pt")}


def test_teacher_topk_is_transformers_topk_in_every_layout(results):
    from transformers import AutoModelForCausalLM

    path, found = results
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    for name, got in found.items():
        for seq, (lp, ids, lps) in zip(_sequences(), got["scored"]):
            with torch.no_grad():
                logp = torch.log_softmax(model(seq[None]).logits[0, :-1].double() / TEMPERATURE, -1)
            top = logp[:, :LIMIT].topk(K, dim=-1)
            # the loss-mask targets only (the prompt's are not computed: NaN log-probs, token 0)
            assert torch.equal(ids[3:], top.indices[3:]), name
            assert torch.allclose(lps[3:].double(), top.values[3:], atol=1e-4), name
            assert torch.allclose(lp[3:].double(), logp.gather(1, seq[1:, None])[3:, 0], atol=1e-4), name
            assert torch.isnan(lps[:3]).all() and torch.isnan(lp[:3]).all() and not ids[:3].any(), name
            assert ids.dtype == torch.long and int(ids.max()) < LIMIT


def test_the_students_topk_update_is_the_same_in_every_layout_and_matches_transformers(results):
    from megatron_rl.algorithms.distill import topk_reverse_kl
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf import build_hf_model

    _, found = results
    single = found["single"]
    assert single["critic"]["value_loss"] == pytest.approx(0.5)  # values 0 at init, returns 1: 0.5 * 1^2
    # the reported KL (token mean over the loss tokens) from transformers' forward of the same student
    student = build_hf_model(ModelConfig(), seed=3).eval()
    total, count = 0.0, 0
    for seq, (_, ids, lps) in zip(_sequences(), single["scored"]):
        with torch.no_grad():
            logp = torch.log_softmax(student(seq[None]).logits[0, :-1].double() / TEMPERATURE, -1)
        kl = topk_reverse_kl(logp.gather(1, ids), lps.double())
        total, count = total + float(kl[3:].sum()), count + len(kl) - 3
    assert single["metrics"]["distill_topk_kl"] == pytest.approx(total / count, rel=1e-4)
    assert total / count > 0.05  # nats per token: the teacher differs, so not a comparison of zeros
    assert single["metrics"]["pg_loss"] == 0.0
    for name in LAYOUTS:
        got = found[name]
        for key in ("loss", "distill_topk_kl", "grad_norm"):
            assert got["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-5), (name, key)
        for key, weight in single["weights"].items():
            assert torch.allclose(got["weights"][key], weight, atol=5e-5), (name, key)
