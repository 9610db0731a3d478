#!/usr/bin/env bash
# The GPU checks moved to scripts/gpu/ (run.sh OUTDIR [checks]); this name still works.
exec bash "$(dirname "$0")/gpu/run.sh" "$@"
