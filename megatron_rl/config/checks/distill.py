"""On-policy distillation's checks (algorithm.distill.*), before any process group or model exists: the run can
distil (an RL run, colocated, sampling, the settings pure distillation has no use for refused), and the teacher
checkpoint is one this build loads, shaped for the parallel layout, with the student's vocabulary."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.checks import ConfigError


def check_distill(cfg) -> None:
    """Every check of algorithm.distill.* against the rest of `cfg`; raises ConfigError. Nothing without a
    teacher."""
    spec = cfg.algorithm.distill
    if spec.teacher is None:
        return
    where = f"algorithm.distill.teacher={spec.teacher}"
    if cfg.mode != "rl":
        raise ConfigError(f"{where} distils on the student's own samples, which mode={cfg.mode} does not draw: "
                          "use mode=rl, or algorithm.distill.teacher=null")
    if cfg.rollout.mode != "colocated":
        raise ConfigError(f"{where} with rollout.mode={cfg.rollout.mode}: the teacher is implemented and tested "
                          "for the colocated rollout only; use rollout.mode=colocated")
    if cfg.rollout.replay_dir is not None:
        raise ConfigError(f"{where} with rollout.replay_dir={cfg.rollout.replay_dir}: replayed samples were not "
                          "drawn from the student being trained, so their KL is not on-policy; drop one of the two")
    if not cfg.rollout.temperature:
        raise ConfigError(f"{where} with rollout.temperature=0: the reverse KL is estimated from sampled tokens, "
                          "and greedy decoding samples none; use rollout.temperature > 0 (1.0: the student's own "
                          "distribution)")
    if spec.estimator == "topk":
        if not cfg.model.fused_logprobs:
            raise ConfigError(f"algorithm.distill.estimator=topk takes the student's log-probs of the teacher's top "
                              "k tokens from its final hidden states (megatron_rl_kernels.logprobs_at), which "
                              "model.fused_logprobs=false does not hand over: set model.fused_logprobs=true (the "
                              "default), or algorithm.distill.estimator=sampled")
        if spec.topk > cfg.model.vocab_size:
            raise ConfigError(f"algorithm.distill.topk={spec.topk} is more tokens than the student's vocabulary "
                              f"(model.vocab_size={cfg.model.vocab_size}): at most {cfg.model.vocab_size} (the "
                              "exact full-vocabulary KL)")
    algo = cfg.algorithm
    if spec.mode == "pure":
        for key, value, why in (
                ("critic", algo.critic, "learns values of the rewards, which pure distillation does not train on"),
                ("filter_zero_variance", algo.filter_zero_variance, "drops samples by their rewards' spread"),
                ("dynamic_sampling", algo.dynamic_sampling, "keeps groups by their rewards' spread")):
            if value:
                raise ConfigError(f"algorithm.{key}=true {why}, but algorithm.distill.mode=pure trains on the "
                                  f"teacher's signal alone: set algorithm.{key}=false, or algorithm.distill.mode=mixed")
    _check_teacher_files(cfg, where)


def _check_teacher_files(cfg, where: str) -> None:
    """The teacher directory: config.json of an architecture this build runs, every weight tensor accounted for,
    heads and layers that split over parallel.tp / pp, and a tokenizer.json with the student's vocabulary."""
    from megatron_rl.config.checks.paths import _vocabulary

    path = Path(cfg.algorithm.distill.teacher).expanduser()
    fix = "give the teacher's HF checkpoint directory (config.json, weights, tokenizer.json)"
    if not path.is_dir():
        raise ConfigError(f"{where} is not a directory: {fix}")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{where} has no config.json: {fix}")
    from megatron_rl.checkpoint.hf import check_tensor_names, check_weight_files
    from megatron_rl.config.teacher import teacher_model_config

    try:
        check_weight_files(path)
        teacher = teacher_model_config(cfg.model, str(path))
        check_tensor_names(path, teacher)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    par = cfg.parallel
    for key, value, size, name in (("num_attention_heads", teacher.num_attention_heads, par.tp, "tp"),
                                   ("num_query_groups", teacher.num_query_groups, par.tp, "tp"),
                                   ("vocab_size", teacher.vocab_size, par.tp, "tp"),
                                   ("num_layers", teacher.num_layers, par.pp, "pp")):
        if value % size:
            raise ConfigError(f"{where}: its {key}={value} does not split over parallel.{name}={size} (the teacher "
                              "runs in the student's parallel layout): pick a parallel layout that divides both")
    _check_teacher_context(cfg, where, teacher.context_length)
    spec = cfg.algorithm.distill
    if spec.estimator == "topk" and spec.topk > teacher.vocab_size:
        raise ConfigError(f"algorithm.distill.topk={spec.topk} is more tokens than the teacher's vocabulary "
                          f"({teacher.vocab_size}, {where}): at most {teacher.vocab_size}")
    student = _vocabulary(cfg.model.tokenizer)
    if student is None:
        raise ConfigError(f"{where}: model.tokenizer={cfg.model.tokenizer} has no tokenizer.json to compare the "
                          "teacher's vocabulary with; distillation needs one (the same token at every id)")
    own = _vocabulary(str(path))
    if own is None:
        raise ConfigError(f"{where} holds no readable tokenizer.json, so it cannot be checked to share the "
                          f"student's tokenizer: copy the tokenizer the teacher was trained with into {path}")
    if own != student:
        differing = next((t for t in sorted(student) if own.get(t) != student[t]), None)
        example = (f"{differing!r} is id {student[differing]} for the student, "
                   f"{own[differing] if differing in own else 'absent'} for the teacher"
                   if differing is not None else "the teacher's has tokens the student's lacks")
        raise ConfigError(f"{where}: its tokenizer differs from the student's (model.tokenizer="
                          f"{cfg.model.tokenizer}; {len(student)} vs {len(own)} tokens; {example}): the teacher would "
                          "score other tokens than the student sampled; distil from a teacher with the student's "
                          "tokenizer, or set model.tokenizer to the teacher's and build the student on it")
    size = max(student.values(), default=-1) + 1
    if size > teacher.vocab_size:
        raise ConfigError(f"{where}: the tokenizer has {size} tokens, more than the teacher's vocab_size="
                          f"{teacher.vocab_size} (its config.json): ids >= {teacher.vocab_size} have no logit")


def _check_teacher_context(cfg, where: str, context: int) -> None:
    """The teacher scores every position of every sample, so a sample must fit its context as the student's must
    (checks/run.py): past it nothing fails, its RoPE runs on positions it never trained on, and its log-probs there
    are no teacher's. `context`: the teacher's ModelConfig.context_length (the prompts' lengths are checked when
    they are read: rl/state.py check_sample_budget)."""
    fix = (f"distil from a teacher with a longer context, or shorten the samples to the teacher's {context} "
           "tokens (its config.json's max_position_embeddings, or YaRN's scaled one)")
    if cfg.rollout.max_new_tokens >= context:
        raise ConfigError(f"{where}: rollout.max_new_tokens={cfg.rollout.max_new_tokens} does not fit the teacher's "
                          f"context ({context}) with a prompt: {fix}")
    agents = {"task": cfg.task} if cfg.task.type == "agent" and not cfg.domains else {}
    agents.update({f"domains.{name}.task": d.task for name, d in cfg.domains.items() if d.task.type == "agent"})
    for key, task in agents.items():
        if task.max_episode_tokens > context:
            raise ConfigError(f"{where}: {key}.max_episode_tokens={task.max_episode_tokens} is more than the "
                              f"teacher's context ({context}): {fix}")
