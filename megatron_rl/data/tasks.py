"""Tasks: prompts with what their reward needs, a reference answer for the warm start, and
the verifier that scores completions.

- `countdown`: generated puzzles; the expression is executed in the sandbox service.
- `arithmetic`: generated word problems that ask a question and state the answer format (`Ann has 3 pens
  and gets 4 more. How many pens does Ann have now? Answer in \\boxed{}.`; `task.math_steps` chains more
  operations); the final answer (`\\boxed{7}`, or `#### 7` with task.answer_format=gsm8k) is checked
  by rule.
- `dataset`: rows from a JSONL / Parquet file or a saved Hugging Face dataset
  (`data/sources.py`): a prompt (text or chat messages), an answer for rule rewards, or
  `tests` (+ optional `files`, `solution_path`) run in the sandbox; an optional full
  `response` for the warm start.

With `task.chat_template=true` (or null, the default, and a tokenizer that has one) prompts are
rendered by the tokenizer's chat template, and the template's end-of-turn token (found by rendering
an assistant turn) ends warm-start responses and stops generation.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
from typing import Any, Callable

from megatron_rl.data import countdown
from megatron_rl.data.countdown import generate_problems
from megatron_rl.data.sources import first_row, load_rows
from megatron_rl.rewards.custom import is_reward_path

MODEL_REWARDS = ("reward_model", "judge")  # task.reward values whose rewards a model gives

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Prompt:
    text: str
    tokens: list[int]
    meta: dict[str, Any]  # what the verifier needs
    reference: str  # a correct response (warm start)


class RuleVerifier:
    """Answers checked by rule (no sandbox needed): `math` (final answer extracted and
    normalised, numeric tolerance; strict, or with the last-number fallback) or `exact` (exact
    match). `answer_counts` counts the math answers, those with no `\\boxed{}` or `####` answer,
    and with the fallback those read by the last number (the step's `reward/answers`,
    `reward/unformatted_answers`, `reward/last_number_answers` and their shares)."""

    errors = 0

    def __init__(self, kind: str = "math", tol: float = 1e-6, last_number: bool = False) -> None:
        self.kind = kind
        self.tol = tol
        self.last_number = last_number
        self.calls = 0
        self.answer_counts = {} if kind != "math" else {"answers": 0, "unformatted_answers": 0,
                                                         **({"last_number_answers": 0} if last_number else {})}

    async def score(self, items) -> list[float]:
        from megatron_rl.rewards.rule import exact_match, score_answer

        self.calls += 1
        if self.kind == "exact":
            return [exact_match(completion, meta["answer"]) for meta, completion in items]
        out, counts = [], self.answer_counts
        for meta, completion in items:
            reward, how = score_answer(completion, meta["answer"], self.tol, self.last_number)
            counts["answers"] += 1
            counts["unformatted_answers"] += how not in ("boxed", "####")
            if self.last_number:
                counts["last_number_answers"] += how == "last_number"
            out.append(reward)
        return out


class ScaledVerifier:
    """Another verifier's rewards times `task.reward_scale` (a task whose rewards come on another
    scale); calls, errors, client and the rest are the inner verifier's."""

    def __init__(self, inner: Any, scale: float) -> None:
        self.inner = inner
        self.scale = scale

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def score(self, items) -> list[float]:
        return [reward * self.scale for reward in await self.inner.score(items)]

    def make_env(self) -> Any:
        """Agent tasks: the inner host's environment, whose `evaluate()` reward is scaled too."""
        return _ScaledEnvironment(self.inner.make_env(), self.scale)


class _ScaledEnvironment:
    def __init__(self, inner: Any, scale: float) -> None:
        self.inner, self.scale = inner, scale

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def evaluate(self) -> float:
        return float(await self.inner.evaluate()) * self.scale


_NAMES = ("Ann", "Bob", "Cy", "Dee", "Eve", "Fay")
_THINGS = ("pens", "cups", "eggs", "hats", "keys")


# The instruction each generated math question ends with, and the answer line of its warm-start reference.
ANSWER_FORMATS = {"boxed": ("Answer in \\boxed{}.", "\\boxed{{{}}}"),
                  "gsm8k": ("End with the answer as #### <number>.", "#### {}")}


def math_problem(rng: random.Random, steps: int = 1) -> tuple[str, str]:
    """(a word problem asking a question, its answer). One step: a gain or a loss (`Ann has 3 pens and gets
    4 more. How many pens does Ann have now?`); more steps chain gains, losses and boxes bought, every count
    on the way >= 0."""
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    question = f" How many {thing} does {name} have now?"
    if steps == 1:
        if rng.random() < 0.5 or a <= b:
            return f"{name} has {a} {thing} and gets {b} more.{question}", str(a + b)
        return f"{name} has {a} {thing} and loses {b}.{question}", str(a - b)
    text, count = f"{name} has {a} {thing}.", a
    for _ in range(steps):
        kind = rng.choice(("gets", "loses", "buys") if count > 0 else ("gets", "buys"))
        if kind == "gets":
            text, count = text + f" Then {name} gets {b} more.", count + b
        elif kind == "loses":
            lost = min(b, count)
            text, count = text + f" Then {name} loses {lost}.", count - lost
        else:
            boxes, each = rng.randint(2, 4), rng.randint(2, 6)
            text, count = text + f" Then {name} buys {boxes} boxes of {each} {thing}.", count + boxes * each
        b = rng.randint(1, 9)
    return text + question, str(count)


def reward_kind_of(task_cfg: Any) -> str:
    """The verifier a task config uses: task.reward with `auto` resolved (countdown, environment for agent
    tasks, tests when the source's first row has a `tests` column, else math) or `custom`. It reads at most
    one row, so the config checks and the Task that trains agree, before any run directory exists."""
    if is_reward_path(task_cfg.reward):
        return "custom"
    if task_cfg.reward != "auto":
        return task_cfg.reward
    if task_cfg.type == "countdown":
        return "countdown"
    if task_cfg.type == "agent":
        return "program" if getattr(task_cfg, "agent", None) or getattr(task_cfg, "agent_command", None) \
            else "environment"
    if task_cfg.type == "dataset" and task_cfg.path is not None and "tests" in (first_row(task_cfg.path) or {}):
        return "tests"
    return "math"


def needs_sandbox_of(task_cfg: Any) -> bool:
    """Whether the task's rewards run code in the sandbox service (countdown, tests, an environment that
    does not declare `needs_sandbox = False`)."""
    kind = reward_kind_of(task_cfg)
    if kind == "environment":
        from megatron_rl.envs import environment_factory

        return getattr(environment_factory(task_cfg.environment), "needs_sandbox", True)
    return kind in ("countdown", "tests")


def run_needs_sandbox(cfg: Any) -> bool:
    """Whether an RL run's rewards (any domain's) run code in the sandbox service; SFT runs none."""
    tasks = [d.task for d in cfg.domains.values()] or [cfg.task]
    return cfg.mode == "rl" and any(needs_sandbox_of(task) for task in tasks)


class Task:
    def __init__(self, task_cfg: Any, tokenizer: Any) -> None:
        self.cfg = task_cfg
        self.tokenizer = tokenizer
        # task.chat_template=null: the tokenizer's template where it has one (an instruct model's)
        self.chat = (task_cfg.chat_template if task_cfg.chat_template is not None
                     else bool(getattr(tokenizer, "chat_template", None)))
        self.end_of_turn = end_of_turn(tokenizer) if self.chat else ""
        from megatron_rl.data.special_tokens import plain_text_prefix

        # plain text starts as transformers' tokenizer(text) starts it (a BOS for Llama-like tokenizers)
        self.plain_prefix = "" if self.chat else plain_text_prefix(tokenizer)
        if task_cfg.system_prompt and not self.chat and not self.is_agent:
            raise ValueError(f"task.system_prompt is set but task {task_cfg.name}'s prompts are plain text (the "
                             "tokenizer has no chat template), which has no system turn: it would be left out; use a "
                             "tokenizer with a chat template, or put the instruction in the prompts")
        self._rows: dict[str, list[dict[str, Any]]] = {}

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _rows_of(self, split: str) -> list[dict[str, Any]]:
        if split not in self._rows:
            c = self.cfg
            num = c.num_train if split == "train" else c.num_eval
            rows = load_rows(c.path, split, c.num_eval, c.eval_path)
            if split == "train" and num is not None and len(rows) > num:
                logger.warning("task %s: %d of %d training rows are used (task.num_train=%d; null: all)", c.name,
                               num, len(rows), num)
            self._rows[split] = rows[:num]
        return self._rows[split]

    def render(self, prompt: str | list[dict[str, str]]) -> str:
        """The prompt text the model sees (the chat template applied when configured)."""
        if not self.chat:
            if not isinstance(prompt, str):
                raise ValueError(f"task {self.cfg.name}: a prompt given as chat messages needs task.chat_template=true")
            return self.plain_prefix + prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.cfg.system_prompt:
            if any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
                raise ValueError(f"task {self.cfg.name}: a prompt has a system message of its own and "
                                 "task.system_prompt is set, which would give it two system turns: unset "
                                 "task.system_prompt or drop the rows' system messages "
                                 f"(the prompt: {messages!r:.200})")
            messages = [{"role": "system", "content": self.cfg.system_prompt}] + messages
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _prompt(self, prompt: str | list[dict[str, str]], meta: dict[str, Any], reference: str) -> Prompt:
        text = self.render(prompt)
        return Prompt(text, self._encode(text), meta, reference + self.end_of_turn)

    def prompts(self, split: str) -> list[Prompt]:
        """The split's prompts; with task.max_prompt_tokens, those longer are left out (counted in a
        warning; an error when none is left)."""
        prompts, limit = self._prompts(split), self.cfg.max_prompt_tokens
        if limit is None or self.is_agent:
            return prompts
        kept = [p for p in prompts if len(p.tokens) <= limit]
        if len(kept) < len(prompts):
            logger.warning("task %s: %d of %d %s prompts are longer than task.max_prompt_tokens=%d tokens and are "
                           "left out", self.cfg.name, len(prompts) - len(kept), len(prompts), split, limit)
        if prompts and not kept:
            raise ValueError(f"task {self.cfg.name}: every {split} prompt is longer than task.max_prompt_tokens="
                             f"{limit} (the shortest has {min(len(p.tokens) for p in prompts)} tokens)")
        return kept

    def _prompts(self, split: str) -> list[Prompt]:
        num = self.cfg.num_train if split == "train" else self.cfg.num_eval
        if num == 0:
            return []
        kind = self.cfg.type
        if kind == "countdown":
            problems = generate_problems(num, seed=self.cfg.seed, split=split)
            return [self._prompt(countdown.format_prompt(p), {"numbers": list(p.numbers), "target": p.target},
                                 countdown.format_answer(p)) for p in problems]
        if kind == "arithmetic":
            rng = random.Random(self.cfg.seed * 2 + (split == "eval"))
            instruction, answer_line = ANSWER_FORMATS[self.cfg.answer_format]
            out = []
            for _ in range(num):
                question, answer = math_problem(rng, self.cfg.math_steps)
                text = f"{question} {instruction}" + ("" if self.chat else "\n")  # a chat turn ends itself
                meta = {"answer": answer, **({"question": text} if self.model_scored else {})}
                out.append(self._prompt(text, meta, answer_line.format(answer)))
            return out
        if kind == "agent":
            return [Prompt(t["instruction"], [], t, "") for t in self._agent_tasks(split)]
        return [self._row_prompt(row, i, split) for i, row in enumerate(self._rows_of(split))]

    def _agent_tasks(self, split: str) -> list[dict[str, Any]]:
        c = self.cfg
        if c.path is not None:
            return self._rows_of(split)
        from megatron_rl.data import agent_tasks

        num = c.num_train if split == "train" else c.num_eval
        if c.generator == "countdown":  # its held-out split is a property of the problem, as in type=countdown
            return agent_tasks.countdown_tasks(num, seed=c.seed, split=split)
        return agent_tasks.GENERATORS[c.generator](num, seed=c.seed * 2 + (split == "eval"))

    @property
    def is_agent(self) -> bool:
        return self.cfg.type == "agent"

    def _row_prompt(self, row: dict[str, Any], index: int, split: str) -> Prompt:
        c = self.cfg
        where = f"task {c.name} ({split} row {index})"
        if c.prompt_key not in row:
            raise ValueError(f"{where} has no {c.prompt_key!r} column (task.prompt_key); columns: {sorted(row)}")
        if not isinstance(row[c.prompt_key], (str, list)):
            raise ValueError(f"{where}: its {c.prompt_key!r} (task.prompt_key) is {type(row[c.prompt_key]).__name__} "
                             f"{row[c.prompt_key]!r}; a prompt is a string or a list of chat messages")
        if self.reward_kind == "custom":  # the user's function gets the whole row
            meta = dict(row)
            answer = row.get(c.answer_key)
            reference = row.get(c.response_key) or ("" if answer is None else f"\\boxed{{{answer}}}")
        elif self.reward_kind == "tests":
            if not row.get("tests"):
                raise ValueError(f"{where} has no 'tests' for reward=tests")
            meta = {"tests": row["tests"], "files": row.get("files") or {},
                    "solution_path": row.get("solution_path") or "solution.py"}
            reference = row.get(c.response_key) or ""
        elif self.model_scored:  # a model judges the response; the reference answer is optional
            answer = row.get(c.answer_key)
            if answer is None and c.rule_check is not None:
                raise ValueError(f"{where} has no {c.answer_key!r} column (task.answer_key) for "
                                 f"task.rule_check={c.rule_check}")
            if answer is None and self.reward_kind == "judge" and c.judge.show_reference \
                    and "{reference}" in (c.judge.template or ""):
                raise ValueError(f"{where} has no {c.answer_key!r} column (task.answer_key), which task.judge.template "
                                 "shows the judge as {reference}: it would grade against an empty reference; give "
                                 "every row its answer, or leave {reference} out of the template")
            if answer is not None and c.rule_check is not None:
                answer = _reference_answer(answer, c.rule_check, f"{where}: its {c.answer_key!r} (task.answer_key)")
            meta = {"question": row[c.prompt_key], **({} if answer is None else {"answer": str(answer)})}
            reference = row.get(c.response_key) or ("" if answer is None else f"\\boxed{{{answer}}}")
        else:
            if row.get(c.answer_key) is None:
                raise ValueError(f"{where} has no {c.answer_key!r} column (task.answer_key) "
                                 f"for reward={self.reward_kind}")
            answer = _reference_answer(row[c.answer_key], self.reward_kind, f"{where}: its {c.answer_key!r} "
                                       "(task.answer_key)")
            meta = {"answer": answer}
            reference = row.get(c.response_key) or (answer if self.reward_kind == "exact" else f"\\boxed{{{answer}}}")
        return self._prompt(row[c.prompt_key], meta, reference)

    @functools.cached_property
    def reward_kind(self) -> str:
        """The verifier actually used (task.reward with `auto` resolved); read once (every row asks)."""
        return reward_kind_of(self.cfg)

    @property
    def model_scored(self) -> bool:
        """Whether a model gives the rewards (task.reward=reward_model|judge): after generation, not the verifier."""
        return self.reward_kind in MODEL_REWARDS

    @functools.cached_property
    def needs_sandbox(self) -> bool:
        return needs_sandbox_of(self.cfg)

    @functools.cached_property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Token ids that end a response besides the tokenizer's eos: the chat template's end-of-turn token, and
        the checkpoint's other end-of-sequence ids (`end_of_sequence_ids`: generation_config.json's), at which
        SGLang stops too."""
        from megatron_rl.data.special_tokens import stop_ids

        return stop_ids(self.tokenizer, self._encode(self.end_of_turn) if self.end_of_turn else [])

    def reward_scale_of(self, meta: dict[str, Any]) -> float:
        """What the verifier multiplied this prompt's rewards by (task.reward_scale)."""
        return self.cfg.reward_scale

    def verifier_factory(self, sandbox_addresses: list[str]) -> Callable[[], Any]:
        build = self._verifier_factory(sandbox_addresses)
        scale = self.cfg.reward_scale
        # a model-scored task's verifier is its rule check (or nothing): the model's reward is the one scaled
        return build if scale == 1.0 or self.model_scored else (lambda: ScaledVerifier(build(), scale))

    def _verifier_factory(self, sandbox_addresses: list[str]) -> Callable[[], Any]:
        kind = self.reward_kind
        if kind in MODEL_REWARDS:  # the model scores after generation (rollout/judging.py, rl/model_rewards.py)
            check = self.cfg.rule_check
            if check is None:
                return AwaitingModel
            return lambda: RuleVerifier(check, self.cfg.reward_tolerance, self.cfg.answer_extraction == "last_number")
        if kind in ("math", "exact"):
            last_number = self.cfg.answer_extraction == "last_number"
            return lambda: RuleVerifier(kind, self.cfg.reward_tolerance, last_number)
        if kind == "program":
            from megatron_rl.envs.agent_program import AgentProgramHost

            c = self.cfg
            return lambda: AgentProgramHost(c.agent, c.agent_command, c.agent_timeout_s, c.agent_model,
                                            wait_s=c.agent_wait_s)
        if kind == "custom":
            from megatron_rl.rewards.custom import CustomVerifier

            return lambda: CustomVerifier(self.cfg.reward, self.cfg.reward_timeout_s)

        def build():
            from megatron_rl.rewards.sandboxed import CountdownVerifier, TestsVerifier
            from megatron_rl_sandbox.client import SandboxClient

            if kind == "environment":  # no addresses: an environment without a sandbox (needs_sandbox)
                client = SandboxClient(sandbox_addresses, deadline_s=60) if sandbox_addresses else None
                return EnvironmentHost(client, self.cfg.environment, output_limit=self.cfg.max_observation_chars)
            client = SandboxClient(sandbox_addresses, deadline_s=60)
            return CountdownVerifier(client) if kind == "countdown" else TestsVerifier(client)
        return build


def _reference_answer(value: Any, kind: str, what: str) -> str:
    """A row's reference answer as the rule verifier `kind` (math or exact) compares it. Refused: a list or mapping
    (its str() would be compared, which no response states), not-a-number, and one that normalises to nothing
    (an empty reference matches an empty `\\boxed{$}` or `#### .`, so the row would reward a non-answer)."""
    from megatron_rl.rewards.rule import normalize

    if isinstance(value, (list, tuple, dict)) or (isinstance(value, float) and value != value):
        raise ValueError(f"{what} is {type(value).__name__} {value!r}; a reference answer is a string or a number")
    answer = str(value)
    if not (normalize(answer) if kind == "math" else answer.strip()):
        raise ValueError(f"{what} is {answer!r}, which states no answer (empty after reward={kind}'s "
                         "normalisation): every response would be compared with nothing; fix or drop the row")
    return answer


class AwaitingModel:
    """The verifier of a model-scored task without a rule check: a reward of 0 that the model's replaces before
    any use (a sample the model gives no verdict is left unscored, never kept at this 0)."""

    calls = errors = 0

    async def score(self, items) -> list[float]:
        return [0.0] * len(items)


class EnvironmentHost:
    """The reward side of agent tasks: holds the sandbox client (on the reward service's event
    loop) and makes one environment per episode; rewards come from the environments."""

    def __init__(self, client: Any, environment: str, **env_kwargs: Any) -> None:
        from megatron_rl.envs import make_environment

        self.client, self.environment, self.env_kwargs = client, environment, env_kwargs
        self.calls = self.errors = 0  # episodes run / dropped
        make_environment(environment, client=client, **env_kwargs)  # an unknown name fails here, early

    def make_env(self) -> Any:
        from megatron_rl.envs import make_environment

        return make_environment(self.environment, client=self.client, **self.env_kwargs)

    async def score(self, items) -> list[float]:
        raise TypeError("agent tasks are scored by their environments (rollout/multiturn.py), not per completion")


def end_of_turn(tokenizer: Any) -> str:
    """What the chat template puts right after an assistant message's content (e.g. `<|im_end|>`),
    without trailing whitespace; "" when the template adds nothing or the tokenizer has none."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("task.chat_template=true but the tokenizer has no chat template")
    marker = "\u2063MEGATRON_RL_END\u2063"
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    return rendered.split(marker, 1)[1].rstrip() if marker in rendered else ""
