"""Static checks of a task set (no execution): exact and near duplicates, contamination
against evaluation sets, empty or ambiguous descriptions; and the pure arithmetic of the
executed checks (flip rates, verdict flags, difficulty buckets).

Three views of a text, because tasks are code as well as prose:

- `normalize` (exact duplicates): case and whitespace runs folded, every other character
  kept, so `a + b` and `a * b` stay different tasks;
- `tokens` (near duplicates): words, and each punctuation / operator character as a token
  of its own, so a shingle sees the operator a code task turns on;
- `words` (contamination, descriptions): prose words only, punctuation dropped, the usual
  n-gram-overlap convention (a comma does not hide a copied sentence).

Near duplicates use MinHash + LSH from `datasketch` over 5-shingles of `tokens`; a pair is
reported when its estimated Jaccard similarity reaches the threshold. Contamination is the
share of a task's word n-grams (default n=8) that also occur in an evaluation set; a task of
fewer than n words has no n-gram, so it counts as contaminated (share 1) when its whole word
sequence occurs inside an evaluation text. A task is contaminated when the share reaches the
threshold.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Iterable, Optional, Sequence

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
    """Lower-case, whitespace runs collapsed to one space; punctuation and operators kept."""
    return re.sub(r"\s+", " ", text.lower()).strip()


def words(text: str) -> list[str]:
    """Lower-case prose words: punctuation and operators dropped."""
    return re.sub(r"[^\w\s]", " ", text.lower()).split()


def tokens(text: str) -> list[str]:
    """Lower-case words, and every other non-space character as a token of its own (`a*b` -> a, *, b)."""
    return re.findall(r"\w+|[^\w\s]", text.lower())


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
        for gram in ngrams(tokens(text), shingle):
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
    """Per task: the fraction of its word n-grams found in the evaluation texts; for a task of
    fewer than `n` words (no n-gram), 1.0 if its word sequence occurs inside an evaluation text."""
    eval_grams: set[tuple[str, ...]] = set()
    eval_lines = []
    for text in eval_texts:
        eval_words = words(text)
        eval_grams |= ngrams(eval_words, n)
        eval_lines.append(" ".join(eval_words))
    # one text per line, each word space-delimited: a match is whole words of one evaluation text
    corpus = "".join(f" {line} \n" for line in eval_lines)
    out = []
    for text in texts:
        task_words = words(text)
        if not task_words:
            out.append(0.0)
        elif len(task_words) < n:
            out.append(1.0 if f" {' '.join(task_words)} " in corpus else 0.0)
        else:
            grams = ngrams(task_words, n)
            out.append(len(grams & eval_grams) / len(grams))
    return out


def description_flags(tasks: Sequence[dict[str, Any]], min_words: int = 3) -> list[list[str]]:
    """`empty_description` (fewer than min_words words), `ambiguous` (the same description as
    another task that expects a different answer or runs different tests)."""
    def description(task: dict[str, Any]) -> str:
        prompt = task.get("instruction", task.get("prompt", ""))
        return " ".join(words(prompt if isinstance(prompt, str) else " ".join(m.get("content", "") for m in prompt)))

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


def verdict_flags(reference: Sequence[float], bad: Sequence[float], min_verdicts: int = 2) -> tuple[float, list[str]]:
    """(flip rate, flags) from a task's scored verdicts (the sandbox's lost verifications left out).
    `unverified`: a candidate has fewer than `min_verdicts` scored verdicts, so its stability went
    unmeasured (an infrastructure failure, no verdict on the task); the verdicts that did come
    back are still judged: `flaky` (flip rate > 0), else `unsolvable` (a reference verdict < 1),
    and `accepts_bad_candidate` (a stable known-bad verdict > 0)."""
    rate = max(flip_rate(reference), flip_rate(bad))
    flags = []
    if min(len(reference), len(bad)) < min_verdicts:
        flags.append("unverified")
    if rate > 0:
        flags.append("flaky")
    elif reference and min(reference) < 1.0:
        flags.append("unsolvable")
    if bad and max(bad) > 0 and rate == 0:
        flags.append("accepts_bad_candidate")
    return rate, flags


def pass_rate(rewards: Sequence[float]) -> Optional[float]:
    """Share of the (scored) rewards that pass (>= 1); None when there is none to judge by."""
    return sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else None


def difficulty_bucket(pass_rate: float) -> str:
    """never (0), hard (<= 0.25), medium (<= 0.75), easy (< 1), always (1)."""
    if pass_rate <= 0.0:
        return "never"
    if pass_rate >= 1.0:
        return "always"
    return "hard" if pass_rate <= 0.25 else "medium" if pass_rate <= 0.75 else "easy"
