"""Export a run's training checkpoint as a Hugging Face checkpoint, offline:

    python -m megatron_rl.export --run RUN_DIR [--checkpoint latest|best|STEP|NAME|DIR] [--out DIR]
        [--dtype bfloat16|float16|float32] [--adapter] [key=value ...]

The run's config.yaml gives the model; `key=value` overrides change the layout the weights are
loaded in (cluster.nproc=2 parallel.tp=2, ...): any TP / PP / EP / CP layout reads any other's
checkpoint (only the weights are read). The output is what checkpoint.hf_export_* writes during
training (config.json, safetensors shards, the tokenizer), by default under RUN_DIR/hf/<checkpoint
name>; logs go to RUN_DIR/export/<timestamp>/. A LoRA run (model.lora_rank > 0) exports its adapters merged
into the weights, or with --adapter alone as a PEFT adapter (adapter_config.json, adapter_model.safetensors;
by default under RUN_DIR/peft/<checkpoint name>) whose base is the run's model.path, or, for a model built
from its config, the frozen base weights written beside it as an HF checkpoint (<out>/base). A damaged
checkpoint (a file missing, truncated or changed since the save: checked against its manifest) is refused,
naming the file (docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

from megatron_rl import runtime

DTYPES = ("bfloat16", "float16", "float32")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.export", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--run", required=True, help="run directory written by `python -m megatron_rl.train`")
    parser.add_argument("--checkpoint", default="latest",
                        help="latest (default), best, a step number, a checkpoint name (step_00000010) or directory")
    parser.add_argument("--out", default=None, help="output directory (default RUN/hf/<checkpoint name>)")
    parser.add_argument("--dtype", default=None, choices=DTYPES, help="tensor dtype (default: the model's)")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run's adapters alone, as a PEFT adapter (default: merged into the weights)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the run's config")
    return parser.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> None:
    from megatron_rl.checkpoint.integrity import refuse_damaged
    from megatron_rl.evaluation.runner import load_run_config, resolve_checkpoints

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        found = resolve_checkpoints(args.run, [args.checkpoint])
        if found[0].kind != "train":
            raise ValueError(f"--checkpoint {args.checkpoint} is an HF directory already ({found[0].path})")
        refuse_damaged(Path(found[0].path), checksums=False)  # the digests: when the ranks load it
        logs = Path(args.run) / "export" / time.strftime("%Y%m%d-%H%M%S")
        cfg = load_run_config(args.run, logs, args.overrides, needs_held_out=False)
        if args.adapter and not cfg.model.lora_rank:
            raise ValueError(f"--adapter: the run {args.run} trained no LoRA adapters (model.lora_rank=0); "
                             "export the model without --adapter")
        if args.adapter and cfg.model.expert_lora_targets:
            raise ValueError(f"--adapter: the run {args.run} trained adapters on its experts "
                             f"({', '.join(cfg.model.expert_lora_targets)}), which export merged only: "
                             "export the model without --adapter")
    except ValueError as exc:  # ConfigError is one
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    ckpt = found[0]
    out = Path(args.out or Path(args.run) / ("peft" if args.adapter else "hf") / Path(ckpt.path).name).resolve()
    rt = runtime.start_with_config(cfg, argv, "megatron_rl.export")
    if rt is None:  # this process launched the local workers, which did the work
        return
    try:
        export(rt, Path(ckpt.path), out, args.dtype, args.adapter)
    finally:
        runtime.finish(rt)


def export(rt, checkpoint: Path, out: Path, dtype: str | None = None, adapter: bool = False) -> Path:
    """Load `checkpoint`'s weights into a trainer of this run's layout and write them to `out` (every
    rank calls this); with `adapter`, the LoRA adapters as a PEFT adapter (see the module's docstring)."""
    import logging

    import torch

    from megatron_rl.checkpoint.hf import export_hf, export_peft_adapter
    from megatron_rl.checkpoint.training import load_weights
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    cfg = rt.cfg
    tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.trust_remote_code)
    trainer = Trainer(cfg.model, cfg.optimizer, rt.groups, TrainerOptions(
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer, pad_token_id=tokenizer.pad_token_id))
    step = load_weights(trainer, checkpoint)
    dtype = getattr(torch, dtype) if dtype else None
    if adapter:  # a config-built model's frozen base goes beside the adapter
        base = str(Path(cfg.model.path).resolve()) if cfg.model.path else None
        path = export_peft_adapter(trainer.module, trainer.groups, trainer.model_cfg, out, base, tokenizer,
                                   max_shard_size=cfg.checkpoint.hf_max_shard_size, dtype=dtype)
    else:
        path = export_hf(trainer.module, trainer.groups, trainer.model_cfg, out, tokenizer,
                         max_shard_size=cfg.checkpoint.hf_max_shard_size, dtype=dtype)
    logging.getLogger(__name__).info("exported %s (step %d) to %s", checkpoint, step, path)
    if rt.is_main:
        print(f"exported {checkpoint} (step {step}) to {path}")
    return path


if __name__ == "__main__":
    main()
