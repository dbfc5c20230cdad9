#!/usr/bin/env bash
# Creates .venv from uv.lock with Python 3.12 (pyenv or PATH). Idempotent and quick when done.
# Usage: scripts/setup.sh [--extra tpu]
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(command -v python3.12 || true)
if [ -z "$python" ] && command -v pyenv >/dev/null; then
  python=$(pyenv root)/versions/$(pyenv versions --bare | grep '^3\.12' | tail -1)/bin/python3.12
fi
[ -x "$python" ] || { echo "setup: Python 3.12 not found (install it, e.g. with pyenv)" >&2; exit 1; }
if [ ! -x .tools/bin/uv ]; then
  "$python" -m venv .tools
  .tools/bin/pip install --quiet "uv==0.13.8"
fi
UV_PROJECT_ENVIRONMENT=.venv .tools/bin/uv sync --locked --python "$python" --extra dev "$@" --quiet
