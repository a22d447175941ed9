#!/usr/bin/env bash
# The README's test command: install if needed, then run every test tier this machine can run.
# Extra arguments go to pytest, e.g. `bash launch/test.sh -k parity`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup_env.sh
exec .venv/bin/python -m pytest tests -q "$@"
