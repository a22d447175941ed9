"""Multi-turn agent environments (reset / step / evaluate) over sandbox sessions."""

from megatron_rl.envs.base import ENVIRONMENTS, Environment, InfrastructureError, make_environment, register_environment

__all__ = ["ENVIRONMENTS", "Environment", "InfrastructureError", "make_environment", "register_environment"]
