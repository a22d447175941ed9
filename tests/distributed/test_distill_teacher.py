"""The distillation teacher (trainer/teacher.py) gives transformers' log-probs: a teacher checkpoint of another
architecture than the student (a 2-layer Llama of width 64, the student a tiny Qwen2), loaded through
`teacher_model_config` and scored in one gloo process, against transformers' teacher-forced forward of the same
checkpoint, at temperature 1 and at 0.5 (logits / 0.5, as the trainer's log-probs at the
rollout temperature). Its weights never train: they are the checkpoint's after scoring."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_spawned
from tests.unit.test_distill import save_teacher

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
TOL = 1e-4


def _sequences() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 99, (n,), generator=gen) for n in (12, 7, 20)]


def _worker(rank: int, world: int, path: str, out: str) -> None:
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import TrainerOptions
    from megatron_rl.trainer.packing import Sample
    from megatron_rl.config.teacher import teacher_model_config
    from megatron_rl.trainer.teacher import Teacher

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    groups = state.initialize(1, 1)
    student = ModelConfig()  # tiny_qwen2's defaults: the teacher takes only its tokenizer, dtype and kernels
    samples = [Sample(s, torch.ones(len(s) - 1)) for s in _sequences()]
    found = {}
    for temperature in (1.0, 0.5):
        teacher = Teacher(teacher_model_config(student, path), OptimizerConfig(), groups,
                          TrainerOptions(micro_batch_tokens=32, logprob_temperature=temperature))
        found[temperature] = teacher.score(samples)
    found["trainable"] = sum(p.requires_grad for p in teacher.trainer.module.parameters())
    torch.save(found, out)


def test_teacher_scores_as_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_teacher(tmp_path / "teacher", sharpen=4.0)
    out = tmp_path / "found.pt"
    run_spawned(_worker, 1, str(path), str(out), timeout_s=500)
    found = torch.load(out)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    assert found["trainable"] == 0
    for temperature in (1.0, 0.5):
        for seq, got in zip(_sequences(), found[temperature]):
            with torch.no_grad():
                logits = model(seq[None]).logits[0, :-1].double() / temperature
            want = torch.log_softmax(logits, -1).gather(-1, seq[1:, None])[:, 0]
            assert got.shape == want.shape
            assert torch.allclose(got.double(), want, atol=TOL), (temperature, (got.double() - want).abs().max())
    # the two temperatures give different numbers: the check above compared each with its own
    assert not torch.allclose(found[1.0][0], found[0.5][0], atol=1e-2)
