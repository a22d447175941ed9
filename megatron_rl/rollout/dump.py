"""Rollouts on disk: each RL step's samples as one JSON line per sample (`logging.dump_rollouts`),
and read back by `rollout.replay_dir` to train on them again without generating.

What a replay is for: debugging the update on fixed data (a step that diverged, a loss change),
comparing algorithm settings on the same samples, or running the trainer side alone while the
engine is being fixed. A replayed run that starts from the same weights and settings as the run
that dumped the samples repeats its update metrics exactly (on CPU, bit for bit).

A line holds every field of the `Rollout` (or agent `Episode`): prompt and output token ids, the
engine's log-probs, reward, status, weight version, for episodes the model-token mask and turn
versions, with rollout routing replay the engine's MoE routing (int16 bytes in base64);
`prompt_text` / `response_text` (decoded with special tokens) are there to read, a replay uses the
token ids. Files are written whole or not at all (temporary file, then rename).
JSON lines rather than torch.save: readable with any tool, and nothing executes on loading.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_rl.rollout.source import ControllerVersion

_NAME = "step_{:08d}.jsonl"


def dump_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / _NAME.format(step)


def dumped_steps(directory: str | Path) -> list[int]:
    """The steps with a dump in `directory`, ascending."""
    steps = []
    for path in Path(directory).glob("step_*.jsonl"):
        try:
            steps.append(int(path.stem.split("_", 1)[1]))
        except ValueError:
            continue
    return sorted(steps)


def write_rollouts(directory: str | Path, step: int, rollouts: Sequence[Any],
                   decode: Optional[Callable[[list[int]], str]] = None) -> Path:
    """Write one step's rollouts; returns the file."""
    from megatron_rl.rollout.multiturn import Episode

    path = dump_path(directory, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "w") as out:
        for r in rollouts:
            row = {"kind": "episode" if isinstance(r, Episode) else "rollout", **dataclasses.asdict(r)}
            if row.get("routing") is not None:  # the engine's MoE routing: int16 bytes, base64 (lists: 5x larger)
                row["routing"] = {"shape": list(r.routing.shape),
                                  "int16_base64": base64.b64encode(r.routing.numpy().astype("<i2").tobytes()).decode()}
            if decode is not None:
                row["prompt_text"], row["response_text"] = decode(r.prompt_tokens), decode(r.output_ids)
            out.write(json.dumps(row, default=str) + "\n")
    os.replace(tmp, path)
    return path


def read_rollouts(directory: str | Path, step: int) -> list[Any]:
    """One step's rollouts as written by `write_rollouts` (Rollout / Episode objects)."""
    from megatron_rl.rollout.collect import Rollout
    from megatron_rl.rollout.multiturn import Episode

    path = dump_path(directory, step)
    if not path.is_file():
        steps = dumped_steps(directory)
        have = f"steps {steps[0]}..{steps[-1]} ({len(steps)} files)" if steps else "no dumps"
        raise FileNotFoundError(f"rollout.replay_dir={directory} has no rollouts of step {step} ({path.name}); it "
                                f"holds {have}: replay as many steps as were dumped (num_steps)")
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        row = json.loads(line)
        cls = Episode if row.get("kind") == "episode" else Rollout
        names = {f.name for f in dataclasses.fields(cls)}
        if row.get("routing") is not None:
            import numpy as np
            import torch

            raw = np.frombuffer(base64.b64decode(row["routing"]["int16_base64"]), dtype="<i2")
            row["routing"] = torch.from_numpy(raw.astype(np.int16).reshape(row["routing"]["shape"]))
        try:
            out.append(cls(**{k: v for k, v in row.items() if k in names}))
        except TypeError as err:
            raise ValueError(f"{path}:{number}: not a dumped rollout: {err}") from None
    return out


class ReplaySource(ControllerVersion):
    """The RolloutSource of `rollout.replay_dir` (megatron_rl/rollout/source.py): each step's dumped samples,
    nothing generated, so no rollout metrics. Its weight version is the colocation controller's (which only
    evaluations advance)."""

    def __init__(self, directory: str | Path, controller: Any) -> None:
        self.directory, self.controller = directory, controller

    def rollouts(self, step: int, timeline: Any) -> tuple[list, dict[str, float]]:
        return read_rollouts(self.directory, step + 1), {}
