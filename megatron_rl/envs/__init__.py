"""Multi-turn agent environments (reset / step / evaluate) over sandbox sessions."""

from megatron_rl.envs.base import (ENVIRONMENTS, Environment, InfrastructureError, environment_factory,
                                   known_bad_turns, make_environment, reference_turns, register_environment,
                                   system_prompt)

__all__ = ["ENVIRONMENTS", "Environment", "InfrastructureError", "environment_factory", "known_bad_turns",
           "make_environment", "reference_turns", "register_environment", "system_prompt"]
