#!/usr/bin/env bash
# One command for the whole test suite on a fresh machine: makes .venv if needed, installs the
# CPU torch wheel when torch is absent (an unpinned torch would pull a multi-GB CUDA build),
# installs the package with its test extra, checks lint, runs pytest on parallel workers.
# --fast (first argument): only the tests that start no process (`-m "not job"`, tests/tiers.py),
# about 1000 in a minute on 2 cores; the whole suite (no flag) is CI's and the README's.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
workers=4
if [ "${1:-}" = "--fast" ]; then
  shift
  tier=(-m "not job")
  workers=2  # these compute rather than wait: more workers than cores only adds start-up
fi
source scripts/_venv.sh
python -m ruff check .
# On parallel workers (pytest-xdist): most of the suite waits on real jobs, sleeps and timeouts
# rather than computing, so more workers than cores pays off. --dist loadgroup keeps each group
# (every reader of the one reference demo run, each module's shared job) on one worker; see
# tests/conftest.py. PYTEST_WORKERS=0 runs in this process, one test at a time.
python -m pytest -n "${PYTEST_WORKERS:-$workers}" --dist loadgroup "${tier[@]}" "$@"
