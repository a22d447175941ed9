"""The SGLang integration tier's infrastructure: a separate venv with SGLang on CPU
(setup.sh, cpu_shims/), the scenario script run inside it (engine_scenarios.py) and the
project-venv side that drives it (harness.py)."""
