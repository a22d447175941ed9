"""Multi-turn agent environments (reset / step / evaluate) over sandbox sessions."""

from megatron_rl.envs.base import (ENVIRONMENTS, Environment, InfrastructureError, environment_factory,
                                   make_environment, reference_turns, register_environment, system_prompt)

__all__ = ["ENVIRONMENTS", "Environment", "InfrastructureError", "environment_factory", "make_environment",
           "reference_turns", "register_environment", "system_prompt"]
