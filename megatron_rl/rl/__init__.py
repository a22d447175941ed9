"""The RL loop, as its pieces:

- state.py: `RunState`, everything one run holds (trainer, optional critic, reference and KL controller,
  the rollout source, rewards, sampler, checkpointer, metrics sink), built by `build_run`, with the
  `state_dict` an exact resume needs;
- loop.py: `run_rl`, start or resume, then the steps, evaluations and checkpoints;
- step.py: one RL step as its phases; advantages.py (shaping, advantages, sample selection),
  update.py (old and reference log-probs, the policy and critic updates), metrics.py (a step's
  metrics, assembled in one place); model_rewards.py (the reward-model phase, task.reward=reward_model) with
  reward_model.py (a served reward model: a value-head Trainer loaded from a sequence classifier);
- warm_start.py (supervised steps before RL), evaluate.py (held-out evaluation, in the loop and of
  checkpoints offline).

Modules below the loop (rollout, trainer, algorithms, evaluation, quality, disagg) never import
this package.
"""
