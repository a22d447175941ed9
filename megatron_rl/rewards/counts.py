"""A reward verifier's running counts at a point in time, and what it counted since: the step's
`reward/verifier_calls`, `reward/verifier_errors` and answer counts (colocated mode: the trainer's verifier;
disaggregated: each generator's, sent with its groups)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class VerifierCounts:
    """A reward verifier's running counts (calls, errors, how rule verifiers read answers) when taken."""

    calls: float
    errors: float
    answers: dict

    @classmethod
    def of(cls, verifier: Any) -> "VerifierCounts":
        return cls(getattr(verifier, "calls", 0), getattr(verifier, "errors", 0),
                   dict(getattr(verifier, "answer_counts", {})))

    def since(self, verifier: Any) -> dict[str, float]:
        out = {"reward/verifier_calls": float(getattr(verifier, "calls", 0) - self.calls),
               "reward/verifier_errors": float(getattr(verifier, "errors", 0) - self.errors)}
        out.update({f"reward/{k}": float(v - self.answers.get(k, 0))
                    for k, v in getattr(verifier, "answer_counts", {}).items()})
        return out
