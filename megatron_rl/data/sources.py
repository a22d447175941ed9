"""Prompt datasets on disk: rows (dicts) from a JSONL file, a Parquet file, or a Hugging Face
`datasets` dataset written by `save_to_disk`, and the train / held-out split of them.

Reading is delegated to the libraries that own the formats (`pyarrow.parquet`,
`datasets.load_from_disk`); this module only decides which one to call and where the
held-out rows come from:

- `eval_path` set: held-out rows are that source's rows, training rows all of `path`'s;
- a `DatasetDict` with a `train` split: training rows from it, held-out rows from its
  `test` or `validation` split when present;
- otherwise the first `num_eval` rows are held out and the rest train (a fixed split, so
  that a resumed run sees the same rows).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

EVAL_SPLITS = ("test", "validation")


def detect_format(path: str | Path) -> str:
    """jsonl (.jsonl/.json), parquet (.parquet) or hf_disk (a directory from `save_to_disk`)."""
    p = Path(path).expanduser()
    if p.is_dir():
        if not any((p / name).exists() for name in ("dataset_info.json", "dataset_dict.json", "state.json")):
            raise ValueError(f"{p} is a directory but not a dataset saved with datasets' save_to_disk "
                             "(no dataset_dict.json / dataset_info.json / state.json)")
        return "hf_disk"
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    raise ValueError(f"cannot tell the format of {p}: use a .jsonl or .parquet file, or a directory written by "
                     "datasets' save_to_disk")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not a JSON object ({err.msg})") from None
    return rows


def _read_hf_disk(path: Path) -> dict[str, list[dict[str, Any]]]:
    """{split: rows}; a plain Dataset is returned as the single split "train"."""
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - datasets is an install requirement
        raise ImportError("reading a saved Hugging Face dataset needs datasets: pip install datasets") from err
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        return {name: split.to_list() for name, split in loaded.items()}
    return {"train": loaded.to_list()}


def read_splits(path: str | Path) -> dict[str, list[dict[str, Any]]]:
    """All rows of a source, by split ("train" only unless the source is a DatasetDict)."""
    p = Path(path).expanduser()
    fmt = detect_format(p)
    if fmt == "jsonl":
        return {"train": _read_jsonl(p)}
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return {"train": pq.read_table(p).to_pylist()}
    return _read_hf_disk(p)


def first_row(path: str | Path) -> Optional[dict[str, Any]]:
    """The source's first row (of its train split, else its first split) without reading the rest; None
    when it has none."""
    p = Path(path).expanduser()
    fmt = detect_format(p)
    if fmt == "jsonl":
        with open(p) as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        return json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{p}:{number}: not a JSON object ({err.msg})") from None
        return None
    if fmt == "parquet":
        import pyarrow.parquet as pq

        batch = next(pq.ParquetFile(p).iter_batches(batch_size=1), None)
        return batch.to_pylist()[0] if batch is not None and batch.num_rows else None
    import datasets

    loaded = datasets.load_from_disk(str(p))  # memory-mapped: row 0 alone is read
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()), [])
    return dict(loaded[0]) if len(loaded) else None


def load_rows(path: str | Path, split: str, num_eval: int, eval_path: Optional[str | Path] = None
              ) -> list[dict[str, Any]]:
    """The rows of `split` ("train" or "eval") following the rules in the module docstring."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} is invalid: allowed values are train, eval")
    splits = read_splits(path)
    if eval_path is not None:
        if split == "train":
            return [row for rows in splits.values() for row in rows] if "train" not in splits else splits["train"]
        return [row for rows in read_splits(eval_path).values() for row in rows][:num_eval]
    held_out = next((name for name in EVAL_SPLITS if name in splits), None)
    if "train" in splits and held_out is not None:
        return splits["train"] if split == "train" else splits[held_out][:num_eval]
    rows = splits.get("train") or [row for rows in splits.values() for row in rows]
    return rows[:num_eval] if split == "eval" else rows[num_eval:]
