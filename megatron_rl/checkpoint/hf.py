"""Hugging Face checkpoints in and out of the Megatron model.

In: the config.json is read into ModelConfig fields, each of its keys mapped, ignored by name or refused
(`families.convert.fields`), and every tensor of the checkpoint must be one the architecture reads or
one its family ignores by name (`check_tensor_names`: a rotary cache, a tied output layer, prediction
layers nobody runs); each rank then reads from the safetensors files (single file, or the shards listed in
`model.safetensors.index.json`) only the tensors its pipeline stage needs (of a mixture of
experts, only its expert-parallel rank's experts), checks them
against the architecture, converts them with the family's converter and keeps its
tensor-parallel shard. Out: the full model is gathered (TP all-gather, PP exchange),
converted back, and rank 0 writes safetensors shards, an index, `config.json` and the
tokenizer files into a temporary directory that is renamed into place when complete. A LoRA run's
adapters go out merged into the weights (`export_hf`) or alone as a PEFT adapter (`export_peft_adapter`).

Errors name the file and the mismatch (wrong family, missing shard, every missing or unaccounted tensor, every
refused config.json key, wrong shape, a shard shorter or longer than its header declares: `check_weight_files`,
which config validation runs too).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_rl.families import converter_for_model_type, get_converter

logger = logging.getLogger(__name__)
Tensor = torch.Tensor


def read_config(path: str | Path) -> dict[str, Any]:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{cfg_path} does not exist: not an HF checkpoint directory")
    with open(cfg_path) as f:
        return json.load(f)


def arch_from_hf_config(path: str | Path) -> dict[str, Any]:
    """ModelConfig field values (family included) from an HF checkpoint's config.json; raises ValueError
    naming every key the family neither maps nor ignores (`DenseDecoderConverter.check_config`)."""
    hf = read_config(path)
    where = Path(path) / "config.json"
    try:
        converter = converter_for_model_type(hf.get("model_type"))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    quantization = hf.get("quantization_config")
    if quantization:
        # e.g. DeepSeek-V3's release: fp8 weights with per-block scales in `*.weight_scale_inv`, which a
        # plain cast would read without their scales
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        raise ValueError(f"{where}: quantization_config (quant_method={method!r}) is not supported: the "
                         "weights must be dequantised to bf16 or fp32 first (and quantization_config removed)")
    converter.check_config(hf, where)
    hf = with_transformers_defaults(hf)
    try:
        return converter.arch_from_config(hf, where)
    except KeyError as exc:
        raise ValueError(f"{where}: missing key {exc}") from None


def with_transformers_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """`hf` (a config.json) with the keys it leaves out that change the math (`rms_norm_eps`,
    `max_position_embeddings`, the RoPE theta) set to what transformers' config class for its model_type
    defaults to: what transformers runs such a checkpoint with, which differs between families (Mixtral's
    theta 1e6 and eps 1e-5, Llama's 2048 positions), and not ModelConfig's own defaults."""
    import transformers

    try:
        defaults = transformers.AutoConfig.for_model(hf["model_type"])
    except (KeyError, ValueError):  # an unknown model_type was refused before this is reached
        return hf
    out = dict(hf)
    for key in ("rms_norm_eps", "max_position_embeddings"):
        if key not in out and getattr(defaults, key, None) is not None:
            out[key] = getattr(defaults, key)
    entries = [out.get(key) for key in ("rope_scaling", "rope_parameters")]
    if "rope_theta" not in out and not any(isinstance(e, dict) and "rope_theta" in e for e in entries):
        # transformers 5: default_theta / rope_parameters; 4.x: rope_theta
        theta = getattr(defaults, "default_theta", None) or (getattr(defaults, "rope_parameters", None) or {}).get(
            "rope_theta") or getattr(defaults, "rope_theta", None)
        if theta is not None:
            out["rope_theta"] = theta
    return out


def describe_names(names: Any) -> str:
    """Tensor names for an error message, all of them; names that differ only in their layer number are
    written once: 'model.layers.{0,1,5}.self_attn.o_proj.bias'."""
    layers: dict[str, list[str]] = {}
    for name in sorted(names):
        match = re.match(r"^(.*?\.layers\.)(\d+)(\..*)$", name)
        key = match.group(1) + "{}" + match.group(3) if match else name
        layers.setdefault(key, []).append(match.group(2) if match else "")
    parts = []
    for key, numbers in layers.items():
        numbers = sorted(numbers, key=lambda n: int(n or 0))
        parts.append(repr(key.replace("{}", numbers[0] if len(numbers) == 1 else "{" + ",".join(numbers) + "}")))
    return ", ".join(parts)


def check_tensor_names(path: str | Path, arch: Any, files: Optional[dict[str, Path]] = None) -> None:
    """Every tensor of the HF checkpoint at `path` is one `arch` reads or one its family ignores by name
    (`ignored_hf_tensor`), and none it reads is missing; raises ValueError naming all the others. Only names
    are read (the index, the safetensors headers); `files` is the tensor -> file map when already resolved."""
    path = Path(path)
    converter = get_converter(arch.family)
    files = files if files is not None else _tensor_files(path)
    needed = converter.hf_names(arch, range(arch.num_layers), True, True)
    unread = [n for n in files if n not in needed and converter.ignored_hf_tensor(n, arch) is None]
    missing = needed - set(files)
    problems = []
    if unread:
        problems.append(f"{len(unread)} tensor(s) that model.family={arch.family} with this config.json does not "
                        f"read, and would drop: {describe_names(unread)}")
    if missing:
        problems.append(f"no tensor {describe_names(missing)} ({len(missing)} missing)")
    if problems:
        raise ValueError(f"{path}: the checkpoint has " + "; and ".join(problems) + " (does config.json describe "
                         "these weights?)")


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}, not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{index}: unreadable index ({type(exc).__name__}: {exc}): restore it from the "
                         "checkpoint's source") from None
    return weight_map


def _shard_problem(fpath: Path) -> Optional[str]:
    """What is wrong with the safetensors file `fpath`, judged from its header alone (None: nothing): no
    header, or a size other than the header's length plus the data length its tensors' offsets declare
    (a truncated download, a copy cut short, a zeroed file)."""
    size = fpath.stat().st_size
    with open(fpath, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"truncated: {size} bytes, shorter than a safetensors header"
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            return f"truncated or not safetensors: {size} bytes, its first 8 bytes declare a {length}-byte header"
        try:
            header = json.loads(f.read(length))
            ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
            expected = 8 + length + max(ends, default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            return f"not safetensors (zeroed or overwritten?): its header does not parse ({type(exc).__name__})"
    if size != expected:
        return (f"{'truncated' if size < expected else 'longer than its header declares'}: {size} bytes, its "
                f"header declares {expected}")
    return None


def check_weight_files(path: str | Path) -> None:
    """Check, from the index and the safetensors headers alone (no tensor is read), that the HF checkpoint
    directory `path` holds its weights whole: `model.safetensors`, or an index whose every shard is present;
    each file as long as its header declares. Raises ValueError naming the file."""
    _tensor_files(Path(path))


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file holding it; every file checked against its header (`_shard_problem`)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = {name: path / fname for name, fname in _weight_map(index).items()}
        for fpath in sorted(set(files.values())):
            if not fpath.exists():
                raise ValueError(f"{fpath}: shard listed in {index} is missing")
            if problem := _shard_problem(fpath):
                raise ValueError(f"{fpath}: shard listed in {index} is {problem}")
        return files
    single = path / "model.safetensors"
    if not single.exists():
        raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")
    if problem := _shard_problem(single):
        raise ValueError(f"{single}: {problem}")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def read_tensors(path: str | Path, names: Optional[set[str]] = None,
                 files: Optional[dict[str, Path]] = None, rows: Optional[dict[str, range]] = None) -> dict[str, Tensor]:
    """Tensors of an HF checkpoint directory; with `names`, only those are read. `files` is
    the tensor -> file map when the caller already resolved it; `rows` reads only those rows (dim 0)
    of the tensors it names."""
    from safetensors import safe_open

    path = Path(path)
    files = files if files is not None else _tensor_files(path)
    wanted = set(files) if names is None else names
    missing = wanted - set(files)
    if missing:
        raise ValueError(f"{path}: checkpoint has no tensor {describe_names(missing)} ({len(missing)} missing)")
    by_file: dict[Path, list[str]] = {}
    for name in sorted(wanted):
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, Tensor] = {}
    for fpath, keys in by_file.items():
        with safe_open(str(fpath), framework="pt") as f:
            for key in keys:
                if rows and key in rows:
                    out[key] = f.get_slice(key)[rows[key].start:rows[key].stop]
                else:
                    out[key] = f.get_tensor(key)
    return out


def check_family(path: str | Path, family: str) -> None:
    hf = read_config(path)
    expected = get_converter(family).model_type
    if hf.get("model_type") != expected:
        raise ValueError(f"{Path(path) / 'config.json'}: model_type={hf.get('model_type')!r}, but "
                         f"model.family={family} expects {expected!r}; pick the matching model config")


def stage_tensors(path: str | Path, arch: Any, layers: range, first_stage: bool, last_stage: bool,
                  experts: Optional[range] = None) -> dict[str, Tensor]:
    """The HF tensors one pipeline stage (and expert-parallel rank: `experts`, None = all) needs,
    read from `path` and checked against `arch`."""
    path = Path(path)
    check_family(path, arch.family)
    converter = get_converter(arch.family)
    names = converter.hf_names(arch, layers, first_stage, last_stage, experts)
    files = _tensor_files(path)
    check_tensor_names(path, arch, files)
    stacked = converter.stacked_expert_names(names)
    rows = {name: experts for name in stacked} if experts is not None else {}
    tensors = read_tensors(path, names, files, rows)
    if arch.tie_word_embeddings and "lm_head.weight" in files and "model.embed_tokens.weight" in tensors:
        # transformers (>= 5) uses a stored output layer that differs from the embedding, tied or not
        head = read_tensors(path, {"lm_head.weight"}, files)["lm_head.weight"]
        if not torch.equal(head, tensors["model.embed_tokens.weight"]):
            raise ValueError(f"{files['lm_head.weight']}: tensor 'lm_head.weight' differs from "
                             "'model.embed_tokens.weight', but config.json says tie_word_embeddings=true: transformers "
                             "computes with the stored output layer (an untied model); set tie_word_embeddings=false")
    sizes = f"vocab_size={arch.vocab_size}, hidden_size={arch.hidden_size}, ffn_hidden_size={arch.ffn_hidden_size}"
    if arch.is_moe:
        sizes += f", num_experts={arch.num_experts}, moe_ffn_hidden_size={arch.moe_ffn_hidden_size}"
    for name, shape in converter.expected_hf_shapes(arch, names).items():
        if name in rows:  # this rank's rows of a stacked expert tensor
            shape = (len(rows[name]), *shape[1:])
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{files[name]}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                             f"the configured architecture needs {shape} ({sizes})")
    return tensors


def load_hf_into_model(model: torch.nn.Module, path: str | Path, arch: Any, groups) -> None:
    """Set this rank's stage of `model` from the HF checkpoint at `path`."""
    from megatron_rl.weight_sync.sharding import layer_offset, load_full_state_dict

    offset = layer_offset(model)
    num_local = len(model.decoder.layers) if hasattr(model, "decoder") else 0
    experts = None
    if arch.is_moe:
        per_rank = arch.num_experts // groups.ep_size
        experts = range(groups.ep_rank * per_rank, (groups.ep_rank + 1) * per_rank)
    tensors = stage_tensors(path, arch, range(offset, offset + num_local), groups.is_first_stage,
                            groups.is_last_stage, experts)
    converted = get_converter(arch.family).hf_to_megatron(tensors, arch, experts.start if experts else 0)
    load_full_state_dict(model, converted, groups)
    logger.info("loaded %d tensors from %s", len(tensors), path)


def _staging_path(out_dir: Path) -> Path:
    """`<out_dir>.tmp`, where an export is written before `_into_place` renames it."""
    return out_dir.with_name(out_dir.name + ".tmp")


def _staging_dir(out_dir: Path) -> Path:
    """`_staging_path(out_dir)`, created empty."""
    tmp = _staging_path(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _into_place(tmp: Path, out_dir: Path) -> None:
    """The complete export `tmp` becomes `out_dir` (replacing an older one)."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def export_hf(model: torch.nn.Module, groups, arch: Any, out_dir: str | Path,
              tokenizer: Any = None, max_shard_size: str = "5GB", dtype: Optional[torch.dtype] = None,
              merged: bool = True) -> Path:
    """Write the model as an HF checkpoint directory; every rank must call this. A model with LoRA adapters
    is written with the adapters merged into its weights, or with `merged` False its frozen base weights.

    The directory appears complete or not at all (written as `<out_dir>.tmp`, then renamed).
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from megatron_rl.models.gpt import torch_dtype
    from megatron_rl.models.hf import fp32_tensors, hf_config, kept_in_fp32
    from megatron_rl.weight_sync.sharding import gather_full_state_dict

    full = gather_full_state_dict(model, groups, merged)
    out_dir = Path(out_dir)
    if groups.rank == 0:
        hf = get_converter(arch.family).megatron_to_hf(full, arch)
        if arch.tie_word_embeddings:
            hf.pop("lm_head.weight", None)  # transformers re-ties it on load
        eos = getattr(tokenizer, "eos_token_id", None) or 0
        config = hf_config(arch, eos)
        source, source_config = _source_checkpoint(arch, getattr(tokenizer, "eos_token_id", None))
        for key, value in source_config.items():  # its special tokens as they were (Llama 3.1's three end ids, ...)
            if key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                setattr(config, key, value)
        keep = fp32_tensors(config)  # not rounded to `dtype`: transformers holds them in fp32
        hf = {k: (v.to(dtype) if dtype and not kept_in_fp32(k, keep) else v).contiguous() for k, v in hf.items()}
        tmp = _staging_dir(out_dir)
        split = split_torch_state_dict_into_shards(hf, max_shard_size=max_shard_size)
        for fname, keys in split.filename_to_tensors.items():
            save_file({k: hf[k] for k in keys}, str(tmp / fname), metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in hf.values())},
                     "weight_map": split.tensor_to_filename}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config.dtype = dtype or torch_dtype(arch.dtype)
        config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if source is not None and (source / "generation_config.json").is_file():
            # where generate() and the engines take the end-of-turn ids and the model's sampling defaults from
            shutil.copyfile(source / "generation_config.json", tmp / "generation_config.json")
        _into_place(tmp, out_dir)
        logger.info("exported HF checkpoint to %s (%d tensors)", out_dir, len(hf))
    if dist.is_initialized():
        dist.barrier()
    return out_dir


def _source_checkpoint(arch: Any, eos: Optional[int]) -> tuple[Optional[Path], dict[str, Any]]:
    """(the HF checkpoint directory the model was loaded from (model.path), its config.json), whose special token
    ids and generation_config.json the export keeps; (None, {}) (the tokenizer's eos then) when there is none, or
    when the run's tokenizer (`eos`) is not the checkpoint's (its eos is none of the checkpoint's end ids)."""
    path = getattr(arch, "path", None)
    if not path:
        return None, {}
    if not (Path(path) / "config.json").is_file():
        logger.warning("model.path=%s has no config.json from here: the export's special tokens are the tokenizer's "
                       "eos alone, and no generation_config.json is written", path)
        return None, {}
    config = read_config(path)
    ends = config.get("eos_token_id")
    ends = ends if isinstance(ends, list) else [ends]
    if eos is not None and eos not in ends:
        logger.warning("the tokenizer's eos id %s is none of %s's end ids %s: the export takes the tokenizer's",
                       eos, path, ends)
        return None, {}
    return Path(path), config


def export_peft_adapter(model: torch.nn.Module, groups, arch: Any, out_dir: str | Path, base_model: Optional[str],
                        tokenizer: Any = None, max_shard_size: str = "5GB",
                        dtype: Optional[torch.dtype] = None) -> Path:
    """Write a LoRA model's adapters as a PEFT adapter directory (`adapter_config.json`,
    `adapter_model.safetensors`), for `peft.PeftModel.from_pretrained(<base_model loaded by transformers>, out_dir)`
    or an engine that serves LoRA adapters; every rank must call this. `base_model` (the HF checkpoint the
    adapters belong on) is recorded as `base_model_name_or_path`; None: the model's frozen base weights are
    written as an HF checkpoint (with `tokenizer`) into `<out_dir>/base`, which is recorded. The directory
    appears complete, base included, or not at all.

    Megatron's fused layers become the HF modules the family's converter writes (linear_qkv: q_proj, k_proj,
    v_proj; linear_fc1: gate_proj, up_proj), each with the whole A and its rows of B, so PEFT's update
    (lora_alpha / r) lora_B lora_A of every module is that module's part of the merged update. `target_modules`
    lists the adapted modules by full name: a mixture of experts' adapters are on its dense layers' MLPs (runs
    with adapters on experts export merged only).
    """
    from safetensors.torch import save_file

    from megatron_rl.models.lora import peft_config, peft_tensors
    from megatron_rl.weight_sync.sharding import gather_adapters

    adapters = gather_adapters(model, groups)
    if not adapters:
        raise ValueError("the model has no LoRA adapters (model.lora_rank=0): export the full model instead")
    out_dir = Path(out_dir).resolve()
    tmp = _staging_path(out_dir)  # rank 0 creates it; every rank writes the base into it
    if groups.rank == 0:
        converter = get_converter(arch.family)
        modules = {module: pair for weight, (a, b) in adapters.items()
                   for module, pair in converter.adapter_to_hf(weight, a, b, arch).items()}
        tensors = peft_tensors(modules, dtype)
        config = peft_config(arch.lora_rank, arch.lora_alpha, list(modules), base_model or str(out_dir / "base"))
        _staging_dir(out_dir)
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    if base_model is None:  # every rank: the gather is collective
        if dist.is_initialized():
            dist.barrier()  # tmp exists
        export_hf(model, groups, arch, tmp / "base", tokenizer, max_shard_size=max_shard_size, dtype=dtype,
                  merged=False)
    if groups.rank == 0:
        _into_place(tmp, out_dir)
        logger.info("exported the LoRA adapters of %d modules to %s", len(adapters), out_dir)
    if dist.is_initialized():
        dist.barrier()
    return out_dir
