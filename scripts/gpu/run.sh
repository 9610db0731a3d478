#!/usr/bin/env bash
# GPU checks for a 2-GPU machine (device tool, kind nvidia-h100-x2), run from the source tree:
#   PYTHONPATH=. bash scripts/gpu/run.sh OUTDIR [all|bench|marks|step|state|demo|preflight|nccllog|mismatch|native|ddp|profile|c10dworkers|rank0gone|layouts|stragglers|devicetruth|timing|silent|quiet_exit]
# bench:     recording cost per NCCL op, c10d FR off/on and ours side by side (bench_record, 1 rank)
# step:      ms per training-like step, bare / c10d FR / ours (bench_step, 2 and 4 ranks; fails when
#            ours / bare or ours / bare on a group of its own is over 1.02; STEP_ARGS: more options)
# marks:     what start marks cost a 200 x 4 KiB step, per kind (bench_marks; fails when the
#            default marks, on the first collective after a 0.5 ms pause, cost over 5 %)
# state:     stream-ordered ops, true states, flat memory over 2000 x 64 MiB, watchdog timeout
# demo:      the reference demo on nccl/cuda: pages during the hang, dumps, both analyzers
# preflight: busbw sweep up to 1 GiB
# nccllog:   the demo with NCCL_DEBUG=INFO, its logs through debug_server.tools.nccl_log
# mismatch:  size and type mismatch at #3: live /fr_trace, hang report and CLI name it (fails if not)
# native:    /stacks?native=1 and the verdict while a rank spins in torch.cuda._sleep (py-spy
#            from .whl/: carry .whl; fails without CUDA frames or a category)
# ddp:       DDP on NCCL, rank 1 skips a backward: live verdict, hang report and PyTorch's
#            fr_trace from c10d's own FR (fails if not); per-op cost of the server, no hook
# profile:   /profile of 2 NCCL ranks: merged trace, GPU comm/compute shares (fails if not);
#            also /wait_counters and /tcpstore (scripts/gpu/check_profile.py)
# c10dworkers: NCCL hang, torch's own C++ workers only, frontend attached by store: the
#            verdict names rank 1 (c10d's NCCL recorder, dump_nccl_trace_json; fails if not)
# rank0gone: 4 GPUs (nvidia-h100-x4): a 2x2 mesh, ranks 0 and 2 leave early (exit, then
#            SIGKILL) while 1 and 3 hang on tp: the pages answer 8 s later, show them gone and
#            name them; the frontend exits once the job is gone (fails if not; skipped on <4 GPUs)
# layouts:   needs 4 GPUs (kind nvidia-h100-x4; skipped by `all` on fewer): FSDP2 with a stalled
#            rank, a 2-D mesh TP skip, a pipeline skip; the live verdict, the hang report and
#            our CLI on c10d's dumps (TORCH_NCCL_DUMP_ON_TIMEOUT=1) name rank 2, its group by
#            desc and its line (scripts/gpu/check_layouts.py; fails if not)
# stragglers: DDP on NCCL, rank 1's data loader slowed 40 ms a batch mid-run: /stragglers names
#            it within 10 s with its lag, nobody before; the step time shows the cost (fails if not)
# devicetruth: plain torch.distributed on NCCL (2 GPUs, and 4 where there are): two groups'
#            all_reduces issued in opposite orders by one rank, and one GPU busy with a long
#            kernel before its all_reduce; live /fr_trace and our CLI on c10d's dumps name the
#            rank (order_inversion / gpu_busy; fails if not)
# timing:    whole jobs with TORCH_NCCL_ENABLE_TIMING=1 (what start_debug_server sets) against =0,
#            TIMING_PAIRS pairs: a 12-layer DDP transformer step (bench_timing_model; fails over
#            1.02), then bench_step's micro-steps (printed: launch-bound loops pay 3-20 %)
# silent:    rank 1 stops itself (SIGSTOP) at step 3 on NCCL, plain torch.distributed: the verdict
#            names rank 1, cpu_divergence, its process stopped at its os.kill line, and the pages
#            answer within 1 s while it is silent (scripts/gpu/check_silent_rank.py; fails if not)
# quiet_exit: DDP on NCCL, 40 steps, barrier + destroy_process_group, with and without the server:
#            the lines the server added and how long the frontend outlived torchrun (fails over 3
#            lines, on a C++ trace, or when a process of the job outlives torchrun by 2 s)
# Ports: every job, frontend and benchmark gets a free port found at run time (free_port).
set -u
OUT=${1:-/tmp/gpu_checks}
WHAT=${2:-all}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."  # the source tree, which the checks import (PYTHONPATH=.)
export PYTHONPATH=${PYTHONPATH:-.}
free_port() { python -c "from torch.distributed.elastic.utils.distributed import get_free_port; print(get_free_port())"; }
want() { [ "$WHAT" = all ] || [[ ",$WHAT," == *",$1,"* ]]; }
nvidia-smi -L
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"

FAILED_CHECKS=""
if want bench; then
echo "=== bench_record (nccl, 1 rank): per-op cost, c10d FR off/on and ours side by side ==="
timeout 300 python benchmarks/bench_record.py --device cuda --port $(free_port) 2>&1 | grep -v Warning | tee "$OUT/bench_record.txt"
fi

if want marks; then
echo "=== bench_marks (2 ranks): start marks per kind on a 4 matmuls + 200 x 4 KiB step; fails over 5 % ==="
timeout 300 python benchmarks/bench_marks.py --matmuls --port $(free_port) --max-ratio 1.05 2>&1 | grep -v Warning | tee "$OUT/bench_marks.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || FAILED_CHECKS="$FAILED_CHECKS marks"
fi

if want step; then
# new_comm initialises the default group (as the README teaches); every pairing, ours / bare on
# our group and ours / bare on a group of its own, on 2 ranks and, where there are 4 GPUs, 4.
for NP in 2 4; do
  [ "$(nvidia-smi -L | wc -l)" -ge "$NP" ] || continue
  echo "=== bench_step ($NP ranks): ms per step, bare / bare + c10d FR / ours; fails when a pairing is over 1.02 ==="
  timeout 500 python benchmarks/bench_step.py --device cuda --nproc "$NP" --port $(free_port) --max-ratio 1.02 \
    ${STEP_ARGS:-} --json "$OUT/bench_step_$NP.json" 2>&1 | grep -v Warning | tee "$OUT/bench_step_$NP.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || FAILED_CHECKS="$FAILED_CHECKS step$NP"
done
fi

if want state; then
echo "=== CUDA semantics, states, memory (2000 x 64 MiB) and the watchdog timeout ==="
timeout 200 torchrun --nproc_per_node=2 --master-port=$(free_port) scripts/gpu/check_cuda_semantics.py > "$OUT/state_check_full.txt" 2>&1
[ $? -eq 0 ] || FAILED_CHECKS="$FAILED_CHECKS state"
grep -E "^\[rank|Error|error" "$OUT/state_check_full.txt" | grep -v Warning | tee "$OUT/state_check.txt"
fi

if want preflight; then
echo "=== preflight busbw sweep to 1 GiB ==="
timeout 300 torchrun --nproc_per_node=2 --master-port=$(free_port) -m debug_server.preflight --max-size 1073741824 --iters 20 --json "$OUT/preflight.json" 2>&1 | grep -v "Warning\|^W1126\|^\*" | tee "$OUT/preflight.txt" | tail -40
fi

if want nccllog; then
echo "=== NCCL INFO logs of a demo hang through nccl_log ==="
mkdir -p "$OUT/nccl_logs"
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL NCCL_DEBUG_FILE="$OUT/nccl_logs/nccl.%h.%p.log" \
TEST_BACKEND=nccl TEST_DEVICE=cuda COMM_TIMEOUT=8 HANG_SECONDS=10 FR_DUMP_INTERVAL=2 FR_DUMP_DIR="$OUT/demo_nccllog" DEBUG_SERVER_PORT=$(free_port) \
  timeout 200 torchrun --nproc_per_node=2 --master-port=$(free_port) examples/hang_demo.py > "$OUT/demo_nccllog.log" 2>&1
echo "demo exit: $?"; ls "$OUT/nccl_logs"
python -m debug_server.nccl_log "$OUT"/nccl_logs/*.log; echo "nccl_log exit: $?"
fi

if want demo; then
echo "=== demo on nccl ==="
DEMO_DIR="$OUT/demo"
rm -rf "$DEMO_DIR"
PORT=$(free_port)
TEST_BACKEND=nccl TEST_DEVICE=cuda COMM_TIMEOUT=12 HANG_SECONDS=18 FR_DUMP_INTERVAL=2 FR_STALL_TIMEOUT=4 \
  FR_DUMP_DIR="$DEMO_DIR" DEBUG_SERVER_PORT=$PORT \
  timeout 200 torchrun --nproc_per_node=2 --master-port=$(free_port) examples/hang_demo.py > "$OUT/demo.log" 2>&1 &
DEMO=$!
# Read the pages once the hang began (startup time varies: CUDA, NCCL, torch._inductor imports).
for _ in $(seq 60); do grep -q "phase 2: all_reduce" "$OUT/demo.log" 2>/dev/null && break; sleep 0.5; done
sleep 3
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
echo "--- per-rank pickles: main_comm entries (seq, op, state, first frame), c10d-backed on NCCL ---"
python - "$DEMO_DIR/per_rank" <<'PY'
import sys, glob
from debug_server.dumpio import load_dump
for p in sorted(glob.glob(sys.argv[1] + "/rank_*")):
    es = [e for e in load_dump(p)["entries"] if e["process_group"][0] == "main_comm"]
    f = (es[-1]["frames"] or [{}])[0] if es else {}
    print(p.rsplit("/", 1)[1], [(e["collective_seq_id"], e["profiling_name"], e["state"]) for e in es][-2:],
          f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}")
PY
echo "--- our CLI ---"
python -m debug_server.fr_trace "$DEMO_DIR/per_rank" -p rank_ > "$OUT/our_cli.txt" 2>&1; echo "exit $?"
sed -n '1,12p' "$OUT/our_cli.txt"
ls -la "$DEMO_DIR" | head -30
fi

if want mismatch; then
echo "=== misconfigured #3 (size 1024 vs 2048; all_reduce vs broadcast): live /fr_trace 17 s into the hang, hang report, CLI ==="
OUT="$OUT/mismatch" READ_AT=17 COMM_TIMEOUT=40 TEST_BACKEND=nccl \
  timeout 400 python scripts/gpu/check_mismatch.py 2>&1 | grep -v Warning | tee "$OUT/mismatch.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || FAILED_CHECKS="$FAILED_CHECKS mismatch"
fi

if want native; then
echo "=== native frames (py-spy --native, from .whl/) of a rank spinning in a CUDA kernel before #3, and the verdict ==="
SPIN=40 READ_AT=8 \
  timeout 400 python scripts/gpu/check_native_frames.py --out "$OUT/native" 2>&1 | grep -v Warning | tee "$OUT/native.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || FAILED_CHECKS="$FAILED_CHECKS native"
fi

if want ddp; then
echo "=== DDP on NCCL, rank 1 skips a backward: diagnosed from c10d's own Flight Recorder ==="
timeout 400 python scripts/gpu/check_ddp_skipped_backward.py "$OUT/ddp" 2>&1 \
  | grep -v Warning | tee "$OUT/ddp.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || FAILED_CHECKS="$FAILED_CHECKS ddp"
echo "=== per-op cost of start_debug_server with no hook (c10d FR read only), 1 rank NCCL ==="
timeout 300 python benchmarks/bench_c10d_overhead.py --device cuda --rounds 5 --seconds 4 2>&1 \
  | grep -v "Warning\|frontend on port" | tee "$OUT/bench_c10d_overhead.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || FAILED_CHECKS="$FAILED_CHECKS ddp-bench"
fi

if want profile; then
echo "=== /profile on NCCL: both ranks merged, NCCL kernels as communication, GEMMs as compute; /wait_counters, /tcpstore ==="
timeout 300 torchrun --nproc_per_node=2 --master-port=$(free_port) scripts/gpu/check_profile.py "$OUT/profile" "$(free_port)" \
  > "$OUT/profile_full.txt" 2>&1
[ $? -eq 0 ] || FAILED_CHECKS="$FAILED_CHECKS profile"
grep -E "^(PASS|FAIL)" "$OUT/profile_full.txt" | tee "$OUT/profile.txt"
fi

if want c10dworkers; then
echo "=== NCCL hang seen through torch's own C++ workers only (no sidecar): c10d's NCCL recorder ==="
timeout 400 python scripts/gpu/check_c10d_workers.py "$OUT/c10dworkers" 2>&1 \
  | grep -v Warning | tee "$OUT/c10dworkers.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || FAILED_CHECKS="$FAILED_CHECKS c10dworkers"
fi

if want rank0gone; then
if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then
for how in exit kill; do
echo "=== rank 0 (and 2) leave early by $how on 4 GPUs while ranks 1 and 3 hang: the pages stay ==="
timeout 400 python scripts/gpu/check_rank0_gone.py "$OUT/rank0gone_$how" --rank0 "$how" 2>&1 \
  | grep -E "^(PASS|FAIL)|checks passed" | tee "$OUT/rank0gone_$how.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || FAILED_CHECKS="$FAILED_CHECKS rank0gone-$how"
done
else
echo "=== rank0gone skipped: needs 4 GPUs (device kind nvidia-h100-x4) ==="
fi
fi

if want layouts; then
echo "=== layouts (4 GPUs): FSDP2 stall, 2-D mesh TP skip, pipeline skip: rank 2, its group, its line ==="
NGPU=$(nvidia-smi -L | wc -l)
if [ "$NGPU" -lt 4 ]; then
  echo "layouts needs 4 GPUs, this machine has $NGPU"
  [ "$WHAT" = all ] || FAILED_CHECKS="$FAILED_CHECKS layouts"
else
  READ_AT=12 COMM_TIMEOUT=45 \
    timeout 1200 python scripts/gpu/check_layouts.py "$OUT/layouts" 2>&1 | grep -v Warning | tee "$OUT/layouts.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || FAILED_CHECKS="$FAILED_CHECKS layouts"
fi
fi

if want stragglers; then
echo "=== DDP on NCCL, rank 1's data loader slowed mid-run: /stragglers names it, the step time shows it ==="
timeout 400 python scripts/gpu/check_stragglers.py "$OUT/stragglers" 2>&1 \
  | grep -v Warning | tee "$OUT/stragglers.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || FAILED_CHECKS="$FAILED_CHECKS stragglers"
fi

if want devicetruth; then
NPS="2"; [ "$(nvidia-smi -L | wc -l)" -ge 4 ] && NPS="2 4"
echo "=== device truth: order inversion and a busy GPU on $NPS GPUs, live and CLI on c10d's dumps ==="
# shellcheck disable=SC2086
timeout 580 python scripts/gpu/check_device_truth.py "$OUT/devicetruth" --nproc $NPS ${DT_ARGS:-} 2>&1 \
  | grep -v Warning | tee "$OUT/devicetruth.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || FAILED_CHECKS="$FAILED_CHECKS devicetruth"
fi

if want timing; then
echo "=== c10d's start timing (start_debug_server's default) on a 12-layer DDP transformer step, whole jobs A B B A; fails over 1.02 ==="
timeout 580 python benchmarks/bench_timing_model.py --pairs "${TIMING_PAIRS:-2}" --max-ratio 1.02 2>&1 \
  | grep -v Warning | tee "$OUT/bench_timing_model.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || FAILED_CHECKS="$FAILED_CHECKS timing"
echo "=== the same on bench_step's micro-steps (printed, not a goal: launch-bound loops pay c10d's per-op event) ==="
timeout 580 python benchmarks/bench_step.py --device cuda --nproc 2 --port $(free_port) --timing-ab "${TIMING_PAIRS:-2}" \
  ${STEP_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/bench_timing.txt"
fi

if want silent; then
echo "=== NCCL, rank 1 stopped (SIGSTOP) at step 3: the verdict names it, its state and line; pages within 1 s ==="
timeout 300 python scripts/gpu/check_silent_rank.py "$OUT/silent" 2>&1 \
  | grep -v Warning | tee "$OUT/silent.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || FAILED_CHECKS="$FAILED_CHECKS silent"
fi

if want quiet_exit; then
echo "=== DDP on NCCL ends with and without the server: lines added, C++ traces, the frontend's lifetime ==="
timeout 700 python scripts/gpu/check_quiet_exit.py "$OUT/quiet_exit" 2>&1 \
  | grep -v Warning | tee "$OUT/quiet_exit.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || FAILED_CHECKS="$FAILED_CHECKS quiet_exit"
fi

if [ -n "$FAILED_CHECKS" ]; then
  echo "FAILED checks:$FAILED_CHECKS"
  exit 1
fi
