"""Multi-turn agent environments (reset / step / evaluate) over sandbox sessions."""

from megatron_rl.envs.base import (BUILTIN_ENVIRONMENTS, ENVIRONMENTS, Environment, InfrastructureError,
                                   environment_factory, environment_names, known_bad_turns, make_environment,
                                   reference_turns, register_environment, system_prompt)

__all__ = ["BUILTIN_ENVIRONMENTS", "ENVIRONMENTS", "Environment", "InfrastructureError", "environment_factory",
           "environment_names", "known_bad_turns", "make_environment", "reference_turns", "register_environment",
           "system_prompt"]
