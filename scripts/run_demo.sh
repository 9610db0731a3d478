#!/usr/bin/env bash
# One command for the reference hang demo on a fresh machine (CPU, gloo, 2 ranks): makes .venv if
# needed, installs what is missing, runs the demo under torchrun. Env vars of the demo pass through
# (FR_DUMP_DIR, FR_DUMP_INTERVAL, COMM_TIMEOUT, HANGING_RANK, HANG_SECONDS, DEBUG_SERVER_PORT...).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
exec torchrun --nproc_per_node="${NPROC:-2}" examples/hang_demo.py
