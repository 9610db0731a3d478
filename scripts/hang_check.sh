#!/usr/bin/env bash
# Run the reference demo with N ranks and check the diagnosis from outside, as a user would:
# page latencies during the hang, the hang report, /stacks grouping, both analyzers.
#   PYTHONPATH=. bash scripts/hang_check.sh OUTDIR [NPROC=2] [HANGING_RANK=NPROC-1] [gloo|nccl]
set -u
OUT=${1:-/tmp/hang_check}
NPROC=${2:-2}
HANGING=${3:-$((NPROC - 1))}
BACKEND=${4:-gloo}
DEVICE=cpu; [ "$BACKEND" = nccl ] && DEVICE=cuda
free_port() { python -c "from torch.distributed.elastic.utils.distributed import get_free_port; print(get_free_port())"; }
PORT=${DEBUG_SERVER_PORT:-$(free_port)}
COMM_TIMEOUT=${COMM_TIMEOUT:-40}
DEMO_DIR="$OUT/demo_${NPROC}r_${BACKEND}"
export PYTHONPATH=${PYTHONPATH:-.}
rm -rf "$DEMO_DIR"; mkdir -p "$DEMO_DIR"

TEST_BACKEND=$BACKEND TEST_DEVICE=$DEVICE HANGING_RANK=$HANGING COMM_TIMEOUT=$COMM_TIMEOUT HANG_SECONDS=$((COMM_TIMEOUT + 5)) \
  FR_DUMP_INTERVAL=3 FR_STALL_TIMEOUT=5 FR_DUMP_DIR="$DEMO_DIR" DEBUG_SERVER_PORT=$PORT \
  timeout 300 torchrun --nproc_per_node="$NPROC" --master-port="$(free_port)" examples/hang_demo.py \
  > "$DEMO_DIR.log" 2>&1 &
DEMO=$!
start=$(date +%s)
# Wait for the hang report (the stall watchdog fires FR_STALL_TIMEOUT s into the hang).
while [ -z "$(ls "$DEMO_DIR"/hang_report_*.txt 2>/dev/null)" ] && [ $(( $(date +%s) - start )) -lt 120 ]; do sleep 0.5; done
echo "hang report after $(( $(date +%s) - start )) s from launch: $(ls "$DEMO_DIR"/hang_report_*.txt 2>/dev/null | head -1)"
for page in "fr_trace" "stacks" "" "fr_trace?format=json" "metrics"; do
  for i in 1 2 3; do
    s=$(date +%s%N); code=$(curl -s -m 30 -o "$DEMO_DIR.page.$i" -w '%{http_code}' "localhost:$PORT/$page"); e=$(date +%s%N)
    echo "GET /$page -> $code in $(( (e - s) / 1000000 )) ms"
  done
  cp "$DEMO_DIR.page.1" "$OUT/during_hang_$(echo "${page:-index}" | tr '?=' '__').out"
done
s=$(date +%s%N); curl -s -m 30 -H 'Accept: text/html' "localhost:$PORT/" > "$OUT/during_hang_index.html"; e=$(date +%s%N)
echo "GET / (HTML) in $(( (e - s) / 1000000 )) ms, $(wc -c < "$OUT/during_hang_index.html") bytes"
wait $DEMO; echo "demo exit: $?"
echo "--- verdict (hang report) ---"
sed -n '1,25p' "$(ls "$DEMO_DIR"/hang_report_*.txt | head -1)"
echo "--- /fr_trace during the hang: findings and failing rows ---"
grep -E "^\[|nccl:all_reduce.*\{" "$OUT/during_hang_fr_trace.out" | head -6
echo "--- /stacks during the hang: groups ---"
grep -E "^=== |^Group|ranks? [0-9]" "$OUT/during_hang_stacks.out" | head -12
echo "--- PyTorch fr_trace ---"
python -m torch.distributed.flight_recorder.fr_trace "$DEMO_DIR/per_rank" -p rank_ 2>&1 | grep -E "sequence number|missing ranks" | head -3
echo "--- our CLI ---"
python -m debug_server.fr_trace "$DEMO_DIR/per_rank" -p rank_ 2>/dev/null | sed -n '1,6p'
