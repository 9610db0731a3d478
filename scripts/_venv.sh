# Sourced by run_tests.sh and run_demo.sh: create and activate .venv, install what is missing.
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
if ! python -c "import torch" >/dev/null 2>&1; then
  # The CPU build; users with GPUs bring their own torch (pyproject keeps a range). numpy only
  # because torch warns at every start without it ("Failed to initialize NumPy").
  python -m pip install --quiet "torch==2.13.0" numpy
fi
# py-spy (a dependency on Linux x86_64/aarch64) is a binary, not a module: check it on its own.
NEED_PYSPY=0
case "$(uname -s)-$(uname -m)" in
  Linux-x86_64|Linux-aarch64) [ -x .venv/bin/py-spy ] || NEED_PYSPY=1 ;;
esac
if [ "$NEED_PYSPY" = 1 ] || ! python -c "import debug_server, pytest_aiohttp, pytest_timeout, xdist, hypothesis, prometheus_client, selenium" >/dev/null 2>&1; then
  python -m pip install --quiet -e ".[test]"
fi
# The browser test drives Debian's Chromium (never a browser download; clusters are offline).
# Only for the tests, only where it is missing and apt-get exists; a failure here makes the
# browser tests fail under CI (CI=true) and skip with their reason elsewhere.
if [ "$(basename "$0")" = "run_tests.sh" ] && [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; fi
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver; } \
    >/dev/null 2>&1 || echo "note: could not install chromium (the browser tests will fail in CI, skip elsewhere)" >&2
fi
