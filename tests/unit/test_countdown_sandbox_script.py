"""The sandbox verifier's countdown script (rewards/sandboxed.py: COUNTDOWN_SCRIPT, run by python3 inside the
sandbox) gives the reference checker's verdicts (`countdown.score`) on every candidate, after the verifier's own
screen. It runs here in a plain python3 subprocess: the script's logic, not the sandbox, is under test (the
integration tier runs it in the sandbox)."""

from __future__ import annotations

import json
import subprocess
import sys

from megatron_rl.data.countdown import CountdownProblem, score
from megatron_rl.rewards.sandboxed import COUNTDOWN_SCRIPT, screen_countdown

PROBLEMS = [CountdownProblem((3, 5, 7), 22, ""), CountdownProblem((2, 9, 8), 1, ""),
            CountdownProblem((4, 4, 2), 18, ""), CountdownProblem((6, 1, 3), 3, "")]
CANDIDATES = [
    "3*5+7", "7+3*5", " 3 * 5 + 7 ", "((3)*5)+(7)", "3*5+7\nmore", "3*5+5", "3*5+7+0", "15+7", "3*5*7", "22", "7",
    "3*5+7=22", "3/5+7", "3**5", "-3+5*5", "+3*5+7", "3 5 7", "35+7", "(3*5+7", "()", "", "3*5+07", "0x3*5+7",
    "9-8", "-8+9", "2-9+8", "9-(8)", "-(8-9)", "9+-8", "9--8", "4*4+2", "4*4+2*2", "4*4*4-46", "(4+4)*2+2",
    "6-3", "3", "1*3", "6/2", "6-1-3+1", "(6-1)-3+1", "3*1", "+3", "--6-3", "6+(-3)", "(" * 30 + "6-3" + ")" * 30,
]


def _script_verdicts(items: list[dict], tmp_path) -> list[float]:
    (tmp_path / "verify.py").write_text(COUNTDOWN_SCRIPT)
    (tmp_path / "candidates.json").write_text(json.dumps(items))
    done = subprocess.run([sys.executable, "verify.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_sandbox_script_gives_the_reference_verdicts(tmp_path):
    pairs = [(p, c) for p in PROBLEMS for c in CANDIDATES]
    exprs = [c.strip().split("\n", 1)[0].strip() for _, c in pairs]  # as CountdownVerifier cuts them
    screened = [i for i, e in enumerate(exprs) if screen_countdown(e)]
    verdicts = _script_verdicts([{"expr": exprs[i], "numbers": list(pairs[i][0].numbers),
                                  "target": pairs[i][0].target} for i in screened], tmp_path)
    got = [0.0] * len(pairs)
    for i, v in zip(screened, verdicts):
        got[i] = v
    want = [score(p, c) for p, c in pairs]
    wrong = [(pairs[i][0].numbers, pairs[i][0].target, pairs[i][1], got[i], want[i])
             for i in range(len(pairs)) if got[i] != want[i]]
    assert not wrong
    assert sum(want) >= 12  # the battery holds right answers for every problem, not only wrong ones
    # unary signs are no answer, though Python evaluates them to the target
    assert score(PROBLEMS[1], "-8+9") == 0.0 and eval("-8+9") == PROBLEMS[1].target  # noqa: S307
