#!/usr/bin/env bash
# GPU checks for a 2-GPU machine (device tool, kind nvidia-h100-x2), run from the source tree:
#   PYTHONPATH=. bash scripts/gpu_checks.sh OUTDIR [all|bench|state|demo|preflight|nccllog]
# bench:     recording cost per NCCL op (bench_record, 1 rank)
# state:     the stuck all_reduce shows `started` on the waiting rank, then `completed`
# demo:      the reference demo on nccl/cuda: pages during the hang, dumps, both analyzers
# preflight: busbw sweep up to 1 GiB
# nccllog:   the demo with NCCL_DEBUG=INFO, its logs through debug_server.nccl_log
set -u
OUT=${1:-/tmp/gpu_checks}
WHAT=${2:-all}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
want() { [ "$WHAT" = all ] || [[ ",$WHAT," == *",$1,"* ]]; }
nvidia-smi -L
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"

if want bench; then
echo "=== bench_record (nccl, 1 rank) ==="
timeout 240 python benchmarks/bench_record.py --device cuda --iters 2000 --rounds 7 2>&1 | grep -v Warning | tee "$OUT/bench_record.txt"
fi

if want state; then
echo "=== state of a stuck all_reduce on CUDA ==="
timeout 120 torchrun --nproc_per_node=2 --master-port=29611 scripts/gpu_state_check.py 2>&1 | grep "^\[rank"
fi

if want preflight; then
echo "=== preflight busbw sweep to 1 GiB ==="
timeout 300 torchrun --nproc_per_node=2 --master-port=29613 -m debug_server.preflight --max-size 1073741824 --iters 20 --json "$OUT/preflight.json" 2>&1 | grep -v "Warning\|^W1126\|^\*" | tee "$OUT/preflight.txt" | tail -40
fi

if want nccllog; then
echo "=== NCCL INFO logs of a demo hang through nccl_log ==="
mkdir -p "$OUT/nccl_logs"
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL NCCL_DEBUG_FILE="$OUT/nccl_logs/nccl.%h.%p.log" \
TEST_BACKEND=nccl TEST_DEVICE=cuda COMM_TIMEOUT=8 HANG_SECONDS=10 FR_DUMP_INTERVAL=2 FR_DUMP_DIR="$OUT/demo_nccllog" DEBUG_SERVER_PORT=25998 \
  timeout 200 torchrun --nproc_per_node=2 --master-port=29614 scripts/verify_flight_recorder.py > "$OUT/demo_nccllog.log" 2>&1
echo "demo exit: $?"; ls "$OUT/nccl_logs"
python -m debug_server.nccl_log "$OUT"/nccl_logs/*.log; echo "nccl_log exit: $?"
fi

if want demo; then
echo "=== demo on nccl ==="
DEMO_DIR="$OUT/demo"
rm -rf "$DEMO_DIR"
PORT=25999
TEST_BACKEND=nccl TEST_DEVICE=cuda COMM_TIMEOUT=12 HANG_SECONDS=18 FR_DUMP_INTERVAL=2 FR_STALL_TIMEOUT=4 \
  FR_DUMP_DIR="$DEMO_DIR" DEBUG_SERVER_PORT=$PORT \
  timeout 200 torchrun --nproc_per_node=2 --master-port=29612 scripts/verify_flight_recorder.py > "$OUT/demo.log" 2>&1 &
DEMO=$!
sleep 9
for page in fr_trace stacks; do
  s=$(date +%s.%N); curl -s -m 20 "localhost:$PORT/$page" > "$OUT/during_hang_$page.txt"; e=$(date +%s.%N)
  echo "GET /$page took $(python -c "print(round($e-$s,3))") s"
done
s=$(date +%s.%N); curl -s -m 20 "localhost:$PORT/fr_trace?format=json" > "$OUT/during_hang_fr_trace.json"; e=$(date +%s.%N)
echo "GET /fr_trace?format=json took $(python -c "print(round($e-$s,3))") s"
curl -s -m 20 -H 'Accept: text/html' "localhost:$PORT/" > "$OUT/during_hang_index.html"
wait $DEMO
echo "demo exit: $?"
grep -E "^\[rank|Verdict|Next|fr_trace" "$OUT/demo.log" | grep -v Warning
echo "--- /fr_trace during the hang (Collectives rows with missing ranks) ---"
grep -E "Verdict|nccl:all_reduce.*\{" "$OUT/during_hang_fr_trace.txt" | head -5
sed -n '/=== Verdict ===/,/--- Findings/p' "$OUT/during_hang_fr_trace.txt" | head -8
echo "--- /stacks during the hang (rank 1 sleep line, rank 0 all_reduce) ---"
grep -nE "=== Rank|hang_phase|in all_reduce" "$OUT/during_hang_stacks.txt" | head -12
echo "--- PyTorch fr_trace on per_rank ---"
python -m torch.distributed.flight_recorder.fr_trace "$DEMO_DIR/per_rank" -p rank_ 2>&1 | grep -E "sequence number|missing ranks|group info|collective:" | head -8
python -m torch.distributed.flight_recorder.fr_trace "$DEMO_DIR/per_rank" -p rank_ -j 2>&1 | grep -E "Rank|all_reduce|broadcast" | head -8
echo "--- our CLI ---"
python -m debug_server.fr_trace "$DEMO_DIR/per_rank" -p rank_ > "$OUT/our_cli.txt" 2>&1; echo "exit $?"
sed -n '1,12p' "$OUT/our_cli.txt"
ls -la "$DEMO_DIR" | head -30
fi
