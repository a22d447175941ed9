"""RL algorithms as pure tensor code: advantage estimators, policy losses, KL estimators,
filters and the loss-aggregating objective. No collectives, no process groups: every
function takes explicit tensors and global denominators and returns tensors.

Importing a submodule registers its functions in the registries of `registry`; importing
this package imports them all, so `ADVANTAGE_ESTIMATORS.get(name)` sees every built-in.
"""

from megatron_rl.algorithms import advantages, filters, kl, losses, objective  # noqa: F401  (registers)
from megatron_rl.algorithms.objective import AGG_MODES, aggregate, make_policy_loss_fn
from megatron_rl.algorithms.registry import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, Registry

__all__ = ["ADVANTAGE_ESTIMATORS", "AGG_MODES", "KL_ESTIMATORS", "POLICY_LOSSES", "Registry", "aggregate",
           "make_policy_loss_fn"]
