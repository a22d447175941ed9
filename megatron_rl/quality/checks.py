"""Static checks of a task set (no execution): exact and near duplicates, contamination
against evaluation sets, empty or ambiguous descriptions; and the pure arithmetic of the
executed checks (flip rates, difficulty buckets).

Near duplicates use MinHash + LSH from `datasketch` over word 5-shingles of the
normalised text (lower-case, punctuation and whitespace runs collapsed); a pair is reported
when its estimated Jaccard similarity reaches the threshold. Contamination is the share of
a task's word n-grams (default n=8) that also occur in an evaluation set, the usual
n-gram-overlap measure; a task is contaminated when the share reaches the threshold.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Iterable, Sequence

DIFFICULTY_BUCKETS = ("never", "hard", "medium", "easy", "always")


def task_text(task: dict[str, Any]) -> str:
    """What a task says: its instruction or prompt, and the non-test files it starts from."""
    prompt = task.get("instruction", task.get("prompt", ""))
    if isinstance(prompt, list):  # chat messages
        prompt = "\n".join(m.get("content", "") for m in prompt)
    files = task.get("files") or {}
    code = "\n".join(files[p] for p in sorted(files) if not p.startswith("tests/") and "test_" not in p)
    return f"{prompt}\n{code}".strip()


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^\w\s]", " ", text.lower())).strip()


def words(text: str) -> list[str]:
    return normalize(text).split()


def ngrams(tokens: Sequence[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)} if len(tokens) >= n else \
        ({tuple(tokens)} if tokens else set())


def exact_duplicates(texts: Sequence[str]) -> dict[int, int]:
    """{index: index of its first occurrence} for every later copy (after normalisation)."""
    first: dict[str, int] = {}
    out = {}
    for i, text in enumerate(texts):
        key = hashlib.sha256(normalize(text).encode()).hexdigest()
        if key in first:
            out[i] = first[key]
        else:
            first[key] = i
    return out


def near_duplicates(texts: Sequence[str], threshold: float = 0.8, num_perm: int = 128,
                    shingle: int = 5) -> list[tuple[int, int, float]]:
    """(i, j, estimated Jaccard) for i < j whose MinHash similarity reaches `threshold`."""
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    hashes = []
    for i, text in enumerate(texts):
        m = MinHash(num_perm=num_perm, seed=1)
        for gram in ngrams(words(text), shingle):
            m.update(" ".join(gram).encode())
        hashes.append(m)
        lsh.insert(str(i), m)
    pairs = set()
    for i, m in enumerate(hashes):
        for key in lsh.query(m):
            j = int(key)
            if j != i:
                a, b = min(i, j), max(i, j)
                pairs.add((a, b, round(hashes[a].jaccard(hashes[b]), 4)))
    return sorted(p for p in pairs if p[2] >= threshold)


def contamination(texts: Sequence[str], eval_texts: Iterable[str], n: int = 8) -> list[float]:
    """Per task: the fraction of its word n-grams found in the evaluation texts."""
    eval_grams: set[tuple[str, ...]] = set()
    for text in eval_texts:
        eval_grams |= ngrams(words(text), n)
    out = []
    for text in texts:
        grams = ngrams(words(text), n)
        out.append(len(grams & eval_grams) / len(grams) if grams else 0.0)
    return out


def description_flags(tasks: Sequence[dict[str, Any]], min_words: int = 3) -> list[list[str]]:
    """`empty_description` (fewer than min_words words), `ambiguous` (the same description as
    another task that expects a different answer or runs different tests)."""
    def description(task: dict[str, Any]) -> str:
        prompt = task.get("instruction", task.get("prompt", ""))
        return normalize(prompt if isinstance(prompt, str) else " ".join(m.get("content", "") for m in prompt))

    def expectation(task: dict[str, Any]) -> str:
        keys = ("answer", "tests", "fail_to_pass", "hidden_files", "files")
        return repr([task.get(k) for k in keys])

    flags: list[list[str]] = [[] for _ in tasks]
    by_text: dict[str, set[str]] = {}
    for task in tasks:
        by_text.setdefault(description(task), set()).add(expectation(task))
    for i, task in enumerate(tasks):
        text = description(task)
        if len(text.split()) < min_words:
            flags[i].append("empty_description")
        elif len(by_text[text]) > 1 and not task.get("files"):
            flags[i].append("ambiguous")
    return flags


def flip_rate(verdicts: Sequence[float]) -> float:
    """Share of reruns whose verdict differs from the majority verdict (0 = stable)."""
    if not verdicts:
        return 0.0
    values = [round(v, 6) for v in verdicts]
    majority = max(set(values), key=values.count)
    return sum(v != majority for v in values) / len(values)


def difficulty_bucket(pass_rate: float) -> str:
    """never (0), hard (<= 0.25), medium (<= 0.75), easy (< 1), always (1)."""
    if pass_rate <= 0.0:
        return "never"
    if pass_rate >= 1.0:
        return "always"
    return "hard" if pass_rate <= 0.25 else "medium" if pass_rate <= 0.75 else "easy"
