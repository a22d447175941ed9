"""Importers account for everything, numerically: for each family and each config.json key whose flip the
import maps to another architecture (the table, the refusals and the ignored keys:
tests/unit/test_import_fields.py), a checkpoint transformers builds from the flipped config (random weights,
biases and norms; query and key projections x 6, so that attention is far from uniform and RoPE's variants
show) loaded into Megatron (one process) gives the log-probs transformers computes (<= 1e-4; observed ~1e-6),
its export loads back into transformers bit-exactly, and weight sync fills the hf rollout engine with exactly
the checkpoint's tensors. A guard test checks that each flip moves transformers' own log-probs by far more
than the tolerance: an import that dropped the key (as Llama's and Qwen3's o_proj bias were, 0.67 and 0.77
apart before) cannot pass.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_spawned
from tests.unit.test_import_fields import build_checkpoint, import_flipped, mapped_cases

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

with tempfile.TemporaryDirectory() as _tmp:
    CASES = mapped_cases(Path(_tmp))
TOL = 1e-4
SHARPEN = 6.0


def _sequences() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 99, (n,), generator=gen) for n in (17, 9, 30)]


def _worker(rank: int, world: int, root: str, cases: list, out_root: str) -> None:
    from megatron_rl.checkpoint.hf import arch_from_hf_config, check_tensor_names, export_hf, read_tensors
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.rollout.hf_engine import HFEngine
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.trainer.packing import Sample
    from megatron_rl.weight_sync.stream import sync_weights

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    results = {}
    for family, flip in cases:
        path = Path(root) / f"{family}-{flip}"
        cfg = ModelConfig(**arch_from_hf_config(path), path=str(path))  # as runtime.load_validated does
        check_tensor_names(path, cfg)
        groups = state.initialize(1, 1)
        trainer = Trainer(cfg, OptimizerConfig(), groups, TrainerOptions(micro_batch_tokens=64))
        trainer.initialize_weights()
        logprobs, _ = trainer.forward_logprobs([Sample(s, torch.ones(len(s) - 1)) for s in _sequences()])
        export_hf(trainer.module, groups, cfg, Path(out_root) / f"{family}-{flip}")
        engine = HFEngine(cfg)
        sync_weights(trainer.module, groups, cfg, engine, 1)
        held, stored = engine.hf_state_dict(), read_tensors(path)
        if cfg.tie_word_embeddings:
            held.pop("lm_head.weight", None)
        engine_mismatch = sorted(set(held) ^ set(stored)) or [k for k in stored if not torch.equal(held[k], stored[k])]
        results[(family, flip)] = (logprobs, engine_mismatch)
        state.destroy()
    torch.save(results, Path(out_root) / "results.pt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("flipped")
    for family, flip in CASES:
        path, _ = import_flipped(root, family, flip)
        build_checkpoint(path, seed=21, sharpen=SHARPEN)
    return root


@pytest.fixture(scope="module")
def results(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    run_spawned(_worker, 1, str(checkpoints), CASES, str(out), timeout_s=800)
    return out, torch.load(out / "results.pt")


def _hf_logprobs(path: Path, config=None) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    from tests.reference import teacher_forced_logprobs

    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                                 ignore_mismatched_sizes=config is not None).eval()
    return teacher_forced_logprobs(model, _sequences())


def test_the_table_maps_keys_of_every_family():
    assert {family for family, _ in CASES} == {
        "llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v2", "deepseek_v3",
        "gpt_oss"}
    assert {("llama", "attention_bias"), ("llama", "mlp_bias"), ("qwen3", "attention_bias"),
            ("qwen3_moe", "attention_bias")} <= set(CASES)


@pytest.mark.parametrize(("family", "flip"), CASES)
def test_megatron_computes_what_transformers_computes(checkpoints, results, family, flip):
    _, runs = results
    logprobs, _ = runs[(family, flip)]
    for got, want in zip(logprobs, _hf_logprobs(checkpoints / f"{family}-{flip}"), strict=True):
        assert (got.double() - want).abs().max() <= TOL, (got.double() - want).abs().max()


@pytest.mark.parametrize(("family", "flip"), CASES)
def test_export_and_weight_sync_carry_every_tensor(checkpoints, results, family, flip):
    from transformers import AutoModelForCausalLM

    from megatron_rl.checkpoint.hf import arch_from_hf_config

    out, runs = results
    assert runs[(family, flip)][1] == [], "the hf engine's weights after a sync differ from the checkpoint's"
    exported = out / f"{family}-{flip}"
    original = AutoModelForCausalLM.from_pretrained(checkpoints / f"{family}-{flip}", dtype=torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert type(loaded) is type(original)
    want, got = original.state_dict(), loaded.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert arch_from_hf_config(exported) == arch_from_hf_config(checkpoints / f"{family}-{flip}")


# flips whose effect needs longer sequences than these: guarded where they are compared
GUARDED_ELSEWHERE = {"rope_llama3": "Llama 3.1's scaling changes only wavelengths above 2048 positions; "
                                    "test_family_parity.py compares 300-token sequences (llama3_1) and guards them"}


@pytest.mark.parametrize(("family", "flip"), CASES)
def test_each_flip_changes_the_reference(checkpoints, family, flip):
    """An import that read the flipped checkpoint as the unflipped one could not pass: it would need other
    tensors (which the tensor check refuses), or transformers computes far from the checkpoint with the
    unflipped config."""
    from transformers import AutoConfig

    from megatron_rl.checkpoint.hf import stage_tensors
    from megatron_rl.config.schema import ModelConfig
    from tests.unit.test_import_fields import FAMILIES, written_config

    if flip in GUARDED_ELSEWHERE:
        pytest.skip(GUARDED_ELSEWHERE[flip])
    path = checkpoints / f"{family}-{flip}"
    try:
        arch = ModelConfig(**vars(FAMILIES[family]))
        stage_tensors(path, arch, range(arch.num_layers), True, True)
    except ValueError:
        return  # the unflipped architecture reads other tensors (or another output layer), which loading refuses
    plain = written_config(family)
    config = AutoConfig.for_model(plain.pop("model_type"), **plain)
    flipped, unflipped = _hf_logprobs(path), _hf_logprobs(path, config)
    assert max((a - b).abs().max().item() for a, b in zip(flipped, unflipped)) > 100 * TOL
