#!/usr/bin/env bash
# One command for the whole test suite on a fresh machine: makes .venv if needed, installs the
# CPU torch wheel when torch is absent (an unpinned torch would pull a multi-GB CUDA build),
# installs the package with its test extra, checks lint, runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
python -m ruff check .
python -m pytest "$@"
