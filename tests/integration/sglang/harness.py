"""Project-venv side of the SGLang integration tier.

SGLang lives in its own venv (setup.sh). The tests make the checkpoints here, run
engine_scenarios.py in that venv (one engine per run) and judge its JSON output against
`transformers` here, an implementation independent of the code under test.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Optional, Sequence

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
DEFAULT_VENV = Path("/var/cache/megatron-rl/sglang-venv")
STAMP = ".megatron-rl-sglang-installed"  # written by setup.sh when the install completed

# Random Qwen2 weights at `transformers`' init (std 0.02) give logits near zero: every
# log-prob ~ log(1/128) = -4.85, and a parity check could not tell tokens apart. Scaling the
# embeddings (tied to the output layer) by 5 and the projections by 2 gives an entropy of
# ~3 nats at temperature 0.8 and sampled log-probs spread over [-8, 0].
EMBED_SCALE = 5.0
PROJECTION_SCALE = 2.0


def venv() -> Path:
    return Path(os.environ.get("MEGATRON_RL_SGLANG_VENV", DEFAULT_VENV))


def venv_python() -> Optional[Path]:
    """The SGLang venv's interpreter, or None when setup.sh has not completed."""
    python = venv() / "bin" / "python"
    return python if python.exists() and (venv() / STAMP).exists() else None


def write_checkpoint(out_dir: Path, seed: int) -> Path:
    """A tiny random Qwen2 (the tiny_qwen2 architecture, fp32) with the shipped character
    tokenizer, saved as a HF checkpoint directory."""
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.hf import build_hf_model

    model = build_hf_model(ModelConfig(family="qwen2"), seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_tokens" in name:
                param.mul_(EMBED_SCALE)
            elif param.dim() == 2:
                param.mul_(PROJECTION_SCALE)
    model.save_pretrained(out_dir)
    load_tokenizer("builtin:char").save_pretrained(out_dir)
    return out_dir


def load_checkpoint(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def token_logprobs(model: torch.nn.Module, prompt: Sequence[int], output_ids: Sequence[int],
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced `log_softmax(logits / temperature)` over the output positions:
    (log-probs of `output_ids` [T], the full distributions [T, V])."""
    ids = torch.tensor([list(prompt) + list(output_ids)])
    logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    full = torch.log_softmax(logits, dim=-1)
    return full.gather(-1, torch.tensor(output_ids).unsqueeze(-1)).squeeze(-1), full


def run_scenarios(mode: str, model_a: Path, model_b: Path, out_dir: Path, timeout_s: float = 900) -> dict:
    """Run engine_scenarios.py in the SGLang venv and return its JSON."""
    python = venv_python()
    assert python is not None, "run tests/integration/sglang/setup.sh first"
    out = out_dir / f"{mode}.json"
    log = out_dir / f"{mode}.log"
    env = dict(os.environ, PYTHONPATH=str(REPO), SGLANG_USE_CPU_ENGINE="1",
               # One OpenMP thread per engine process: on a 2-core box the scheduler's default
               # thread pool contends with the other engine processes and decoding gets ~100x slower.
               OMP_NUM_THREADS="1")
    cmd = [str(python), str(HERE / "engine_scenarios.py"), "--mode", mode, "--model-a", str(model_a),
           "--model-b", str(model_b), "--out", str(out)]
    with open(log, "w") as log_file:
        proc = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-6000:]
        raise RuntimeError(f"engine_scenarios.py --mode {mode} exited with {proc.returncode}; log {log}:\n{tail}")
    return json.loads(out.read_text())
