"""The algorithm group (`algorithm.*`): advantages, losses, KL, filters, critic, on-policy distillation.

Each dataclass checks its own fields in ``__post_init__`` (see megatron_rl/config/schema.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from megatron_rl.checks import check_choice as _check_choice
from megatron_rl.checks import check_min as _check_min
from megatron_rl.checks import format_value
from megatron_rl.checks import invalid as _invalid
from megatron_rl.config.common import _check_unit_interval


@dataclass
class DistillConfig:
    """On-policy distillation (`algorithm.distill.*`, megatron_rl/algorithms/distill.py): a teacher scores
    each sampled response token, and the student is pushed down the per-token reverse KL to it."""

    teacher: Optional[str] = None
    """HF checkpoint directory of the teacher (its architecture read from its config.json; any size). It must
    hold a tokenizer.json with the student's vocabulary (the same token at every id, checked before the run
    starts). null: no distillation."""
    coef: float = 1.0
    """Weight of the distillation term: with estimator=sampled of the advantage -(log pi_student(y_t) -
    log pi_teacher(y_t)) added to each response token's advantage; with estimator=topk of the top-k KL loss term."""
    mode: str = "mixed"
    """mixed (the RL objective from the rewards plus coef times the distillation term) or pure (the distillation
    term alone: rewards are still computed and logged but do not enter the update)."""

    estimator: str = "sampled"
    """How the per-token reverse KL reaches the update. sampled: the sampled-token estimate log pi_s(y_t) -
    log pi_t(y_t) as an advantage (the teacher's log-prob of each sampled token only; cheapest). topk: the KL over
    the teacher's `topk` likeliest tokens at each position plus one bucket for the rest, as a loss term with its
    exact gradient (coef x agg over the student's tokens, in loss_agg_mode; with mode=pure it replaces the
    policy-gradient term, while a kl_coef or entropy_coef term still applies): a signal on k tokens per
    position instead of one, which a student far from the teacher (a new model built from config) needs. It costs
    the teacher's top k per token in host memory (12 bytes x k per token on every rank) and a second pass over the
    student's output layer per micro-batch."""
    topk: int = 64
    """estimator=topk: the teacher's tokens kept per position (at most the student's vocabulary; at the vocabulary
    size the KL is the exact full-vocabulary one)."""

    MODES: ClassVar[tuple[str, ...]] = ("mixed", "pure")
    ESTIMATORS: ClassVar[tuple[str, ...]] = ("sampled", "topk")

    def __post_init__(self) -> None:
        _check_choice("algorithm.distill.mode", self.mode, self.MODES)
        _check_choice("algorithm.distill.estimator", self.estimator, self.ESTIMATORS)
        _check_min("algorithm.distill.topk", self.topk, 1)
        _check_min("algorithm.distill.coef", self.coef, 0, strict=True)
        if self.teacher is not None and not str(self.teacher).strip():
            raise _invalid("algorithm.distill.teacher", self.teacher, "give the teacher's HF checkpoint directory, "
                           "or null for no distillation")
        if self.mode == "pure" and self.teacher is None:
            raise _invalid("algorithm.distill.mode", self.mode, "distils from a teacher: set "
                           "algorithm.distill.teacher=<HF checkpoint directory>, or algorithm.distill.mode=mixed")


@dataclass
class AlgorithmConfig:
    """Advantage estimator and policy loss of the RL update."""

    advantage_estimator: str = "grpo"
    """grpo, dr_grpo, rloo, reinforce_pp (group mean, then batch whitening) or gae (with algorithm.critic a
    learned value model's values; without, values 0: with gae_gamma = gae_lambda = 1 every token's advantage
    is its sample's reward, whitened over the batch's tokens; works with one sample per prompt)."""
    gae_gamma: float = 1.0
    """advantage_estimator=gae: discount per response token."""
    gae_lambda: float = 1.0
    """advantage_estimator=gae: GAE's lambda."""
    critic: bool = False
    """advantage_estimator=gae: train a value model (PPO's critic: the policy's architecture and starting
    weights, a zero-initialised value head in place of the output layer, an optimizer of its own) whose
    values V(s_t) enter GAE and which learns GAE's returns after each policy update."""
    critic_lr: float = 1e-5
    """The critic's learning rate (its other optimizer settings are optimizer.*'s)."""
    value_clip: Optional[float] = 0.5
    """The critic's value clipping: its values move at most this far from the pre-update ones in the loss
    (PPO's clipped value loss); null: plain squared error."""
    critic_warmup_steps: int = 0
    """RL steps at the start in which only the critic learns (the policy is not updated)."""
    policy_loss: str = "ppo_clip"
    """ppo_clip, clip_higher (DAPO), gspo (sequence-level ratio) or cispo (clipped IS weights)."""
    eps_clip: float = 0.2
    """Lower clip range of the importance ratio (1 - eps_clip); also the upper one for ppo_clip."""
    eps_clip_high: float = 0.28
    """Upper clip range (1 + eps_clip_high) for clip_higher, gspo and cispo."""
    eps_clip_c: Optional[float] = None
    """Dual clip (ppo_clip, clip_higher): a token with negative advantage A contributes at most -A * eps_clip_c
    (typical 3.0); null: off."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (a loss term, or the reward's penalty with kl_in_reward);
    0 skips the reference model."""
    ref_update_every: int = 0
    """kl_coef > 0: RL steps after which the reference policy becomes the current policy (the KL then
    anchors to a recent policy instead of the start); 0: the reference stays the policy RL started from."""
    kl_estimator: str = "k3"
    """KL estimator: k1, k2 or k3 (Schulman's approximations)."""
    kl_clamp: Optional[float] = 10.0
    """Bound of each token's KL estimate, clamped to [-kl_clamp, kl_clamp] in the KL loss and in the reward's KL
    penalty (verl clamps its k3, low_var_kl, at 10); a clamped token adds the bound and no gradient. null: unbounded
    (TRL's k3; one token at a log-ratio of 20 then adds 5e8)."""
    kl_in_reward: bool = False
    """Apply kl_coef as a per-token penalty in the reward, r_t - kl_coef * kl_t (PPO-RLHF, REINFORCE++; verl's
    use_kl_in_reward), instead of as a KL loss. kl_t: kl_estimator of the policy's log-probs before the update
    against the reference's. A group estimator sees each sample's reward minus kl_coef times its summed KL, gae
    the per-token penalties."""
    kl_target: Optional[float] = None
    """kl_in_reward: adapt kl_coef (then its initial value) towards this KL per token, with Ziegler et al.'s
    controller (megatron_rl/algorithms/kl.py:KLController); null: kl_coef stays fixed."""
    kl_horizon: int = 10000
    """kl_target: the controller's horizon in samples (larger: slower changes of kl_coef)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    loss_agg_mode: str = "token_mean"
    """Loss normalisation: token_mean, seq_mean_token_sum, seq_mean_token_mean or seq_mean_token_sum_norm (Dr.
    GRPO: each sequence's token sum over loss_norm_len)."""
    num_inner_updates: int = 1
    """Optimizer steps taken on each batch of rollouts."""
    routing_replay: str = "none"
    """Mixture-of-experts models (megatron_rl/trainer/routing_replay.py): old (record the experts each token is
    routed to at the old-log-prob forward and route every update's forward the same way, so that the
    importance ratio of later inner updates compares the same experts; needs old_logprobs=recompute),
    rollout (R3: route the old-log-prob forward and every update as the engine did when it generated the
    tokens; the hf engine, or SGLang on CUDA; single-turn tasks; colocated mode) or none. Logs
    routing/drift, the share of expert choices the updated routers would have made differently."""

    ADVANTAGE_ESTIMATORS: ClassVar[tuple[str, ...]] = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gae")
    GROUP_ESTIMATORS: ClassVar[tuple[str, ...]] = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
    POLICY_LOSSES: ClassVar[tuple[str, ...]] = ("ppo_clip", "clip_higher", "gspo", "cispo")
    KL_ESTIMATORS: ClassVar[tuple[str, ...]] = ("k1", "k2", "k3")
    LOSS_AGG_MODES: ClassVar[tuple[str, ...]] = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean",
                                                 "seq_mean_token_sum_norm")
    OLD_LOGPROBS: ClassVar[tuple[str, ...]] = ("auto", "recompute", "current", "rollout")
    ROUTING_REPLAYS: ClassVar[tuple[str, ...]] = ("none", "old", "rollout")

    tis_cap: float = 2.0
    """Cap of the truncated importance-sampling weight that corrects rollout/training log-prob mismatch."""
    rollout_is: str = "token"
    """The rollout correction's weight (megatron_rl/algorithms/losses.py:rollout_correction), from r = the
    trainer's over the engine's probability of a sampled token: token (min(r_t, tis_cap), truncated IS),
    sequence (min(product of the sequence's r, tis_cap)) or none."""
    rollout_mask: str = "none"
    """Drop from the loss what the engine sampled too differently: token (tokens with r_t outside
    [rollout_mask_low, rollout_mask_high]), sequence (sequences whose product of r is outside), geometric
    (sequences whose geometric mean of r is outside) or none."""
    rollout_mask_low: float = 0.5
    """Lower bound of the rollout mask's range (< 1)."""
    rollout_mask_high: float = 2.0
    """Upper bound of the rollout mask's range (> 1)."""
    max_staleness: int = 1
    """rollout.mode=disaggregated: a group generated with weight version v (its oldest token) is trained
    on at trainer version <= v + max_staleness; older groups are dropped (counted). 0 = on-policy."""
    old_logprobs: str = "auto"
    """The log-probs of the policy that sampled, the importance ratio's denominator: recompute (a forward of the
    trainer before the first update), current (the first update's own forward, detached: the same weights, so
    the same numbers without a forward of their own; kept for the later inner updates), rollout (the engine's)
    or auto: current unless kl_in_reward or routing_replay=old needs them before the update, else recompute
    (written resolved to config.yaml)."""
    loss_norm_len: Optional[int] = None
    """Constant length normaliser for loss_agg_mode=seq_mean_token_sum_norm (Dr. GRPO)."""
    filter_zero_variance: bool = False
    """Drop the samples of groups whose rewards are all equal from the update (zero advantage)."""
    overlong: str = "none"
    """Responses that hit rollout.max_new_tokens: none, filter (dropped from the loss) or penalty
    (DAPO's soft length penalty over the last overlong_penalty_window tokens)."""
    overlong_penalty_window: int = 0
    """Tokens before max_new_tokens where the penalty ramps from 0 to -overlong_penalty (overlong=penalty)."""
    overlong_penalty: float = 1.0
    """Reward subtracted from a response that reaches max_new_tokens (overlong=penalty)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: generate more groups until the batch holds global_batch_size /
    n_samples_per_prompt groups with reward variance (or dynamic_sampling_max_rounds rounds ran)."""
    dynamic_sampling_max_rounds: int = 4
    """Generation rounds per step at most with dynamic_sampling; a short batch is trained on, and logged."""
    domain_calibration: str = "none"
    """Multi-domain runs (`domains`): none (advantages from the raw rewards) or running (each domain's
    rewards become (r - mean_d) / std_d with that domain's running statistics before the advantage
    estimator, so that no domain's reward scale dominates; see megatron_rl/algorithms/calibration.py).
    No effect with advantage_estimator=grpo, which already divides by each group's std."""
    domain_calibration_momentum: float = 0.1
    """Weight of the newest step in a domain's running reward statistics (domain_calibration=running);
    the first 1/momentum updates of a domain are an exact running average (warm-up)."""
    domain_pause_window: int = 0
    """Multi-domain runs: RL steps over which a domain's training reward gain and held-out accuracy
    gain are compared to detect reward hacking; 0 never pauses a domain."""
    domain_pause_min_reward_gain: float = 0.2
    """A domain is paused when its training reward (divided by its task.reward_scale) rose by more
    than this over domain_pause_window steps ..."""
    domain_pause_max_eval_gain: float = 0.02
    """... while its held-out accuracy rose by less than this over the same steps."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher checkpoint (its fields: algorithm.distill.*)."""

    OVERLONG_MODES: ClassVar[tuple[str, ...]] = ("none", "filter", "penalty")
    DOMAIN_CALIBRATIONS: ClassVar[tuple[str, ...]] = ("none", "running")

    def __post_init__(self) -> None:
        _check_choice("algorithm.advantage_estimator", self.advantage_estimator, self.ADVANTAGE_ESTIMATORS)
        _check_choice("algorithm.policy_loss", self.policy_loss, self.POLICY_LOSSES)
        _check_unit_interval("algorithm.gae_gamma", self.gae_gamma, low_open=False, high_open=False)
        _check_unit_interval("algorithm.gae_lambda", self.gae_lambda, low_open=False, high_open=False)
        _check_choice("algorithm.kl_estimator", self.kl_estimator, self.KL_ESTIMATORS)
        _check_min("algorithm.ref_update_every", self.ref_update_every, 0)
        if self.ref_update_every and self.kl_coef <= 0:
            raise _invalid("algorithm.ref_update_every", self.ref_update_every, "moves the KL's reference "
                           "policy: it needs algorithm.kl_coef > 0")
        if self.kl_in_reward and self.kl_coef <= 0:
            raise _invalid("algorithm.kl_in_reward", self.kl_in_reward, "penalises the reward by kl_coef times the "
                           "KL: it needs algorithm.kl_coef > 0")
        if self.kl_target is not None:
            if not self.kl_in_reward:
                raise _invalid("algorithm.kl_target", self.kl_target, "adapts the KL penalty in the reward: it "
                               "needs algorithm.kl_in_reward=true")
            _check_min("algorithm.kl_target", self.kl_target, 0, strict=True)
        _check_min("algorithm.kl_horizon", self.kl_horizon, 1)
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            raise _invalid("algorithm.kl_clamp", self.kl_clamp, "must be > 0 (verl: 10.0), or null for no bound")
        if self.critic and self.advantage_estimator != "gae":
            raise _invalid("algorithm.critic", self.critic, "a value model is used by advantage_estimator=gae only, "
                           f"not {self.advantage_estimator}: set algorithm.advantage_estimator=gae (algorithm=ppo)")
        _check_min("algorithm.critic_lr", self.critic_lr, 0, strict=True)
        if self.value_clip is not None:
            _check_min("algorithm.value_clip", self.value_clip, 0, strict=True)
        _check_min("algorithm.critic_warmup_steps", self.critic_warmup_steps, 0)
        if self.critic_warmup_steps and not self.critic:
            raise _invalid("algorithm.critic_warmup_steps", self.critic_warmup_steps, "warms up a critic: it needs "
                           "algorithm.critic=true")
        _check_choice("algorithm.loss_agg_mode", self.loss_agg_mode, self.LOSS_AGG_MODES)
        _check_choice("algorithm.old_logprobs", self.old_logprobs, self.OLD_LOGPROBS)
        if self.old_logprobs == "auto":
            before = self.kl_in_reward or self.routing_replay == "old"
            self.old_logprobs = "recompute" if before else "current"
        _check_choice("algorithm.routing_replay", self.routing_replay, self.ROUTING_REPLAYS)
        _check_choice("algorithm.overlong", self.overlong, self.OVERLONG_MODES)
        if self.overlong == "penalty" and self.overlong_penalty_window < 1:
            raise _invalid("algorithm.overlong_penalty_window", self.overlong_penalty_window,
                           "must be >= 1 with overlong=penalty, e.g. a quarter of rollout.max_new_tokens")
        _check_min("algorithm.overlong_penalty", self.overlong_penalty, 0)
        _check_min("algorithm.dynamic_sampling_max_rounds", self.dynamic_sampling_max_rounds, 1)
        _check_min("algorithm.tis_cap", self.tis_cap, 1.0)
        if self.eps_clip_c is not None:
            if self.eps_clip_c <= 1:
                raise _invalid("algorithm.eps_clip_c", self.eps_clip_c, "must be > 1 (typical 3.0) or null")
            if self.policy_loss not in ("ppo_clip", "clip_higher"):
                raise _invalid("algorithm.eps_clip_c", self.eps_clip_c, f"dual clip applies to policy_loss ppo_clip "
                               f"or clip_higher, not {self.policy_loss}")
        _check_choice("algorithm.rollout_is", self.rollout_is, ("token", "sequence", "none"))
        _check_choice("algorithm.rollout_mask", self.rollout_mask, ("none", "token", "sequence", "geometric"))
        if not 0 < self.rollout_mask_low < 1:
            raise _invalid("algorithm.rollout_mask_low", self.rollout_mask_low, "must lie in (0, 1)")
        if self.rollout_mask_high <= 1:
            raise _invalid("algorithm.rollout_mask_high", self.rollout_mask_high, "must be > 1")
        _check_min("algorithm.max_staleness", self.max_staleness, 0)
        if self.loss_agg_mode == "seq_mean_token_sum_norm" and not self.loss_norm_len:
            raise _invalid("algorithm.loss_norm_len", self.loss_norm_len,
                           "loss_agg_mode=seq_mean_token_sum_norm needs a constant length, e.g. rollout.max_new_tokens")
        _check_min("algorithm.eps_clip", self.eps_clip, 0, strict=True)
        _check_min("algorithm.eps_clip_high", self.eps_clip_high, 0, strict=True)
        if self.policy_loss == "clip_higher" and self.eps_clip_high < self.eps_clip:
            raise _invalid(
                "algorithm.eps_clip_high", self.eps_clip_high,
                f"must be >= algorithm.eps_clip={format_value(self.eps_clip)} for policy_loss=clip_higher",
            )
        _check_min("algorithm.kl_coef", self.kl_coef, 0)
        _check_min("algorithm.entropy_coef", self.entropy_coef, 0)
        _check_min("algorithm.num_inner_updates", self.num_inner_updates, 1)
        _check_choice("algorithm.domain_calibration", self.domain_calibration, self.DOMAIN_CALIBRATIONS)
        _check_unit_interval("algorithm.domain_calibration_momentum", self.domain_calibration_momentum,
                             low_open=True, high_open=False)
        _check_min("algorithm.domain_pause_window", self.domain_pause_window, 0)
        _check_min("algorithm.domain_pause_min_reward_gain", self.domain_pause_min_reward_gain, 0)
