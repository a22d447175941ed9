"""The task group (`task.*`) and a multi-domain run's domains (`domains.<name>.*`).

Each dataclass checks its own fields in ``__post_init__`` (see megatron_rl/config/schema.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from megatron_rl.checks import ConfigError
from megatron_rl.checks import check_choice as _check_choice
from megatron_rl.checks import check_min as _check_min
from megatron_rl.checks import invalid as _invalid
from megatron_rl.config.common import _check_unit_interval


@dataclass
class RewardModelConfig:
    """task.reward=reward_model: a discriminative reward model served in the job (megatron_rl/rl/reward_model.py)."""

    path: Optional[str] = None
    """HF checkpoint directory of a `*ForSequenceClassification` model with num_labels=1 (Qwen2, Llama), saved
    with the policy's tokenizer (it reads the policy's token ids). The reward of a sample is its score at the
    last token that is not the checkpoint's pad token, as transformers computes it."""


@dataclass
class JudgeConfig:
    """task.reward=judge: the policy's own engine reads each response and states a verdict
    (megatron_rl/rewards/judge.py)."""

    template: Optional[str] = None
    """The judge's prompt, with {prompt}, {response} and (when show_reference) {reference}; null: the built-in
    template of the verdict format."""
    show_reference: bool = True
    """Give the judge the row's reference answer (task.answer_key); false: the judge sees prompt and response only."""
    verdict: str = "score"
    """How the judge's reply is read: score (the last `score: X`, 0 <= X <= max_score; reward X / max_score) or
    yes_no (the last word when it is yes or no, else the yes or no the reply says when all agree; reward 1 or
    0). A reply without one is no verdict: the sample is left unscored and counted in
    reward/judge_parse_failures."""
    max_score: float = 10.0
    """verdict=score: the top of the judge's scale."""
    max_new_tokens: int = 64
    """Length limit of the judge's reply (greedy). A reply cut at it is no verdict (counted in reward/judge_cut):
    the verdict comes last, so give the judge room for its reasoning."""

    VERDICTS: ClassVar[tuple[str, ...]] = ("score", "yes_no")

    def __post_init__(self) -> None:
        _check_choice("task.judge.verdict", self.verdict, self.VERDICTS)
        _check_min("task.judge.max_score", self.max_score, 0, strict=True)
        _check_min("task.judge.max_new_tokens", self.max_new_tokens, 1)
        from megatron_rl.rewards.judge import check_template

        try:
            check_template(self.template, self.show_reference)
        except ValueError as err:
            raise ConfigError(str(err)) from None


@dataclass
class TaskConfig:
    """Prompt source and reward of the training task."""

    name: str = "countdown"
    """Display name used in logs and metric names."""
    type: str = "countdown"
    """countdown (generated puzzles), arithmetic (generated word problems), dataset (prompts from `path`; the
    `task=math` config is one, reading {question, answer} rows) or agent (multi-turn episodes)."""
    path: Optional[str] = None
    """Prompt source for type=dataset: a .jsonl or .parquet file, or a directory written by
    Hugging Face datasets' save_to_disk (a DatasetDict's train/test splits are used as such)."""
    eval_path: Optional[str] = None
    """Held-out prompts in any of the same formats; null: the source's test/validation split, or
    else its first num_eval rows."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string, or a list of {role, content} chat messages."""
    answer_key: str = "answer"
    """Column holding the reference answer (rule rewards)."""
    response_key: str = "response"
    """Column holding a full reference response for the warm start (default: \\boxed{answer})."""
    num_train: Optional[int] = 2000
    """Training prompts generated, or read at most (a warning says how many rows of `path` were left out);
    null: every row of `path` (generated tasks need a number)."""
    max_prompt_tokens: Optional[int] = None
    """Leave out prompts longer than this many tokens (after the chat template), counted in a warning;
    null: keep all. Not for agent tasks (task.max_episode_tokens bounds those)."""
    num_eval: int = 200
    """Held-out evaluation prompts; 0 disables evaluation."""
    seed: int = 0
    """Seed of the prompt generator and of the train/eval split."""
    chat_template: Optional[bool] = None
    """Render prompts with the tokenizer's chat template (user turn + generation prompt); responses
    then end with the template's end-of-turn token, which also stops generation. null: whenever the
    tokenizer has a chat template (an instruct model's); true: it must have one; false: plain text."""
    system_prompt: Optional[str] = None
    """System message prepended when chat_template=true; for type=agent it replaces the default
    tool instructions (megatron_rl/envs/tools.py)."""
    reward: str = "auto"
    """Verifier: math (final answer, e.g. \\boxed{}, normalised), exact (exact match), countdown
    (expression executed in the sandbox), tests (the row's tests run in the sandbox: passed/total);
    auto: countdown for type=countdown, tests for dataset rows with a `tests` column, else math;
    or your own function, `package.module:function`, called as function(completion, sample) -> float
    with sample = the prompt's dataset row (megatron_rl/rewards/custom.py); or a model: reward_model (a
    discriminative reward model, task.reward_model.path) or judge (the policy's engine judges, task.judge.*).
    Model rewards are for arithmetic and dataset tasks."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """task.reward=reward_model: the reward model."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """task.reward=judge: the judge's prompt and verdict format."""
    rule_check: Optional[str] = None
    """task.reward=reward_model|judge: a rule verifier (math or exact, on task.answer_key) that also scores every
    sample, for the reward-hacking guard: samples where it and the model disagree are counted
    (reward/model_rule_disagree) and flagged in the audit (model_rule_disagree). The reward stays the model's."""
    rule_check_threshold: float = 0.5
    """The model's score (before task.reward_scale) above which it counts as passing a response, against the rule
    verifier's reward > 0 (a judge's rewards are in [0, 1]; a reward model's scores are its own scale)."""
    reward_tolerance: float = 1e-6
    """Absolute tolerance of numeric answers (reward=math)."""
    answer_extraction: str = "strict"
    """reward=math: how the final answer is read. strict: the last \\boxed{...}, else the text after the
    last `####`; a response with neither scores 0. last_number: as strict, and else the last number in
    the text, a lenient reading that also rewards numbers that merely come last; the step logs the share
    read that way (reward/last_number_share) beside the share with no formatted answer
    (reward/unformatted_share)."""
    answer_format: str = "boxed"
    """type=arithmetic: the answer format each generated question asks for, and its warm-start reference uses:
    boxed (`\\boxed{7}`) or gsm8k (a last line `#### 7`)."""
    math_steps: int = 1
    """type=arithmetic: operations per generated word problem (1: `Ann has 3 pens and gets 4 more. How many
    pens does Ann have now?`; more: a chain of gains, losses and boxes bought, each result >= 0)."""
    reward_timeout_s: float = 60.0
    """reward=package.module:function: seconds one call may take once it runs; a late one is no verdict (the
    sample is left unscored), counted in reward/verifier_errors."""
    environment: str = "repo"
    """type=agent: the environment episodes run in (registered in megatron_rl.envs)."""
    generator: str = "repo"
    """type=agent without a path: generated tasks, repo (fix a bug in a small package), function
    (write one function) or countdown (Countdown with feedback, task.environment=countdown); see
    megatron_rl/data/agent_tasks.py."""
    max_turns: int = 6
    """type=agent: model turns per episode at most."""
    max_episode_tokens: int = 1024
    """type=agent: prompt + all turns and observations of an episode, in tokens, at most."""
    episode_wall_time_s: float = 120.0
    """type=agent: wall time of an episode at most (checked between turns)."""
    max_observation_chars: int = 2000
    """type=agent: tool output shown to the model at most (the middle is cut)."""
    agent: Optional[str] = None
    """type=agent: episodes played by your agent program instead of an environment (docs/agents.md, "Black-box
    agents"): `package.module:function`, called per episode as function(base_url=, episode_id=, task=) and
    returning the reward; it talks to the rollout engine through the job's OpenAI-compatible endpoint."""
    agent_command: Optional[list[str]] = None
    """type=agent: or a command (argv) run per episode, with OPENAI_BASE_URL, MEGATRON_RL_EPISODE_ID,
    MEGATRON_RL_MODEL and MEGATRON_RL_TASK set; its last stdout line is the reward."""
    agent_model: str = "policy"
    """The model name the endpoint serves (requests naming another get 404)."""
    agent_timeout_s: float = 300.0
    """Seconds one episode's agent program may run; a later one is lost (agent_failed), not scored."""
    agent_wait_s: float = 30.0
    """Seconds a call that arrives outside a rollout waits for the next one before it gets HTTP 503."""
    pool_refresh_every: int = 0
    """RL steps between environment-pool refreshes: tasks that became trivial (pool_trivial_pass_rate
    over pool_min_samples samples) or scored one response differently twice are retired and their
    slots refilled from the queue (megatron_rl/data/env_pool.py); 0: off."""
    pool_queue: int = 0
    """Generated tasks held in the pool's queue (generated task types; another seed than training)."""
    pool_queue_path: Optional[str] = None
    """Or: a file of tasks for the queue, in the format of task.path."""
    pool_trivial_pass_rate: float = 0.95
    """Pass rate at which a task counts as trivial."""
    pool_min_samples: int = 32
    """Samples of a task needed before it can be called trivial."""
    reward_scale: float = 1.0
    """Multiplier on the verifier's reward (a task whose rewards come on another scale, e.g. points
    0..10); evaluation divides it back out, so held-out accuracy stays in [0, 1]."""

    TYPES: ClassVar[tuple[str, ...]] = ("countdown", "arithmetic", "dataset", "agent")
    ANSWER_EXTRACTIONS: ClassVar[tuple[str, ...]] = ("strict", "last_number")
    ANSWER_FORMATS: ClassVar[tuple[str, ...]] = ("boxed", "gsm8k")
    GENERATORS: ClassVar[tuple[str, ...]] = ("repo", "function", "countdown")
    REWARDS: ClassVar[tuple[str, ...]] = ("auto", "math", "exact", "countdown", "tests", "reward_model", "judge")
    MODEL_REWARDS: ClassVar[tuple[str, ...]] = ("reward_model", "judge")
    RULE_CHECKS: ClassVar[tuple[str, ...]] = ("math", "exact")

    eval_every: int = 10
    """RL steps between evaluations on the held-out split (0: only at the end)."""
    eval_samples: int = 4
    """Samples per held-out prompt at evaluation (pass@k uses k = this)."""
    eval_temperature: Optional[float] = None
    """Sampling temperature of evaluation (training-time and `python -m megatron_rl.eval`); 0: greedy; null:
    rollout's."""
    eval_top_p: Optional[float] = None
    """Evaluation's top_p; null: rollout.top_p."""
    eval_top_k: Optional[int] = None
    """Evaluation's top_k (1: greedy, with eval_samples=1); null: rollout.top_k."""
    eval_max_new_tokens: Optional[int] = None
    """Evaluation's response length limit; null: rollout.max_new_tokens."""
    sft_warmup_steps: int = 0
    """Supervised steps on the task's reference answers before RL (a warm start; 0: none). Agent
    tasks: on their reference solutions played through the environment and verified."""
    sft_warmup_lr: float = 1e-5
    """Learning rate of the warm start (a pretrained model's; the tiny models' preset sets 1e-3)."""

    def _check_agent_program(self) -> None:
        if self.agent is None and self.agent_command is None:
            return
        key = "task.agent" if self.agent is not None else "task.agent_command"
        if self.type != "agent":
            raise _invalid(key, self.agent or self.agent_command, f"an agent program plays agent tasks, not "
                           f"task.type={self.type}: set task.type=agent or remove {key}")
        if self.agent is not None and self.agent_command is not None:
            raise _invalid("task.agent_command", self.agent_command, "give task.agent (a Python function) or "
                           "task.agent_command (a command), not both")
        if self.agent is not None and (":" not in self.agent or self.agent.startswith(":")
                                       or self.agent.endswith(":")):
            raise _invalid("task.agent", self.agent, "must be package.module:function")
        if self.agent_command is not None and (not self.agent_command or not all(
                isinstance(a, str) and a for a in self.agent_command)):
            raise _invalid("task.agent_command", self.agent_command, "must be a non-empty list of non-empty "
                           "strings (argv), e.g. [python, my_agent.py]")
        if self.reward != "auto":
            raise _invalid("task.reward", self.reward, "an agent program gives its episodes' rewards: leave "
                           "task.reward=auto")
        _check_min("task.agent_timeout_s", self.agent_timeout_s, 0, strict=True)
        _check_min("task.agent_wait_s", self.agent_wait_s, 0)
        if not self.agent_model:
            raise _invalid("task.agent_model", self.agent_model, "must be a non-empty model name")

    @property
    def plays_agent_program(self) -> bool:
        """Whether its episodes are played by an agent program (task.agent / task.agent_command)."""
        return self.agent is not None or self.agent_command is not None

    def __post_init__(self) -> None:
        _check_choice("task.type", self.type, self.TYPES)
        _check_min("task.eval_every", self.eval_every, 0)
        _check_min("task.eval_samples", self.eval_samples, 1)
        if self.eval_temperature is not None:
            _check_min("task.eval_temperature", self.eval_temperature, 0)  # 0: greedy
        if self.eval_top_p is not None:
            _check_unit_interval("task.eval_top_p", self.eval_top_p, low_open=True, high_open=False)
        if self.eval_top_k is not None and self.eval_top_k != -1 and self.eval_top_k < 1:
            raise _invalid("task.eval_top_k", self.eval_top_k, "must be -1 (disabled) or >= 1")
        if self.eval_max_new_tokens is not None:
            _check_min("task.eval_max_new_tokens", self.eval_max_new_tokens, 1)
        _check_min("task.sft_warmup_steps", self.sft_warmup_steps, 0)
        _check_min("task.sft_warmup_lr", self.sft_warmup_lr, 0, strict=True)
        from megatron_rl.rewards.custom import is_reward_path

        custom_reward = is_reward_path(self.reward)  # package.module:function, imported by the run checks
        if not custom_reward:
            _check_choice("task.reward", self.reward, self.REWARDS)
        if self.type == "dataset" and not self.path:
            raise ValueError(f"task.path=null is invalid for task.type=dataset (task {self.name}): set task.path="
                             "<file.jsonl|file.parquet|saved dataset directory>; the {question, answer} rows of "
                             "docs/examples/math.jsonl show task=math's format, and task=arithmetic generates "
                             "word problems with no data")
        _check_choice("task.generator", self.generator, self.GENERATORS)
        if self.type == "agent" and self.path is None and not self.plays_agent_program and (
                self.generator == "countdown") != (self.environment == "countdown"):
            raise _invalid("task.generator", self.generator, "generated countdown tasks run in the countdown "
                           "environment and it plays no other generated tasks: set task.generator and "
                           "task.environment both to countdown, or neither")
        _check_min("task.max_turns", self.max_turns, 1)
        _check_min("task.max_episode_tokens", self.max_episode_tokens, 16)
        _check_min("task.episode_wall_time_s", self.episode_wall_time_s, 0, strict=True)
        _check_min("task.max_observation_chars", self.max_observation_chars, 16)
        self._check_agent_program()
        _check_min("task.pool_refresh_every", self.pool_refresh_every, 0)
        _check_min("task.pool_queue", self.pool_queue, 0)
        _check_unit_interval("task.pool_trivial_pass_rate", self.pool_trivial_pass_rate, low_open=True,
                             high_open=False)
        _check_min("task.pool_min_samples", self.pool_min_samples, 1)
        allowed = {"countdown": ("auto", "countdown"), "arithmetic": ("auto", "math", "exact", *self.MODEL_REWARDS),
                   "agent": ("auto",)}.get(
            self.type, ("auto", "math", "exact", "tests", *self.MODEL_REWARDS))
        if custom_reward and self.type == "agent":
            raise _invalid("task.reward", self.reward, "agent tasks are scored by their environment "
                           "(task.environment); a reward function serves countdown, arithmetic and dataset tasks")
        if self.reward not in allowed and not custom_reward:
            raise _invalid("task.reward", self.reward, f"task.type={self.type} allows {', '.join(allowed)}")
        if self.reward == "reward_model" and not self.reward_model.path:
            raise _invalid("task.reward_model.path", self.reward_model.path, "task.reward=reward_model needs the "
                           "reward model's HF checkpoint directory (a *ForSequenceClassification with num_labels=1)")
        if self.rule_check is not None:
            _check_choice("task.rule_check", self.rule_check, self.RULE_CHECKS)
            if self.reward not in self.MODEL_REWARDS:
                raise _invalid("task.rule_check", self.rule_check, f"it cross-checks a model's rewards "
                               f"(task.reward=reward_model|judge), but task.reward={self.reward}: set task.reward="
                               "math|exact to train on the rule itself, or task.rule_check=null")
        _check_min("task.reward_tolerance", self.reward_tolerance, 0)
        _check_choice("task.answer_extraction", self.answer_extraction, self.ANSWER_EXTRACTIONS)
        _check_choice("task.answer_format", self.answer_format, self.ANSWER_FORMATS)
        _check_min("task.math_steps", self.math_steps, 1)
        _check_min("task.reward_timeout_s", self.reward_timeout_s, 0, strict=True)
        _check_min("task.reward_scale", self.reward_scale, 0, strict=True)
        if self.num_train is not None:
            _check_min("task.num_train", self.num_train, 1)
        elif self.path is None:
            raise _invalid("task.num_train", None, f"task.type={self.type} generates its prompts: give how many "
                           "(null means every row of task.path)")
        if self.max_prompt_tokens is not None:
            _check_min("task.max_prompt_tokens", self.max_prompt_tokens, 1)
        if self.system_prompt and self.chat_template is False and self.type != "agent":
            raise _invalid("task.system_prompt", self.system_prompt, "a system message goes through the chat template, "
                           "and task.chat_template=false renders plain text (it would be left out): set "
                           "task.chat_template=true, or put the instruction in the prompts")
        _check_min("task.num_eval", self.num_eval, 0)
        _check_min("task.seed", self.seed, 0)


@dataclass
class DomainConfig:
    """One domain of a multi-domain joint run (`TrainConfig.domains`): a task set and its share of
    the prompts. The domain's name is its key in `domains`; `weight` is checked by TrainConfig,
    which knows that name."""

    task: TaskConfig = field(default_factory=TaskConfig)
    """The domain's prompts and verifier (its task.reward_scale too). Run-level task settings
    (eval_every, eval_samples, sft_warmup_steps, sft_warmup_lr) are read from the top-level `task`."""
    weight: float = 1.0
    """Mixture weight (> 0): the domain's expected share of each step's prompt groups is
    weight / (sum of the weights of the domains not paused)."""
