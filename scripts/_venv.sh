# Sourced by run_tests.sh and run_demo.sh: create and activate .venv, install what is missing.
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
if ! python -c "import torch" >/dev/null 2>&1; then
  # The CPU build; users with GPUs bring their own torch (pyproject keeps a range).
  python -m pip install --quiet "torch==2.13.0"
fi
if ! python -c "import debug_server, pytest_aiohttp, pytest_timeout, hypothesis, prometheus_client" >/dev/null 2>&1; then
  python -m pip install --quiet -e ".[test]"
fi
