#!/usr/bin/env bash
# Diagnosis of the overlapped step by how the groups are initialised (first made for issue 31) (scripts/gpu/step_by_init_mode.py),
# and what torch's C++ worker on a CUDA build answers (scripts/gpu/capture_c10d_nccl.py).
#   PYTHONPATH=. bash scripts/gpu/diag_step_init.sh OUTDIR
set -u
O=${1:-/tmp/i31}; mkdir -p "$O" /tmp/i31logs
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
nvidia-smi -L
python -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
free_port() { python -c "from torch.distributed.elastic.utils.distributed import get_free_port; print(get_free_port())"; }
job() {  # name nproc args...
  local name=$1 np=$2; shift 2
  timeout 150 torchrun --nproc_per_node=$np --master-port=$(free_port) scripts/gpu/step_by_init_mode.py "$@" > /tmp/i31logs/$name.log 2>&1
  echo "== $name np=$np $* rc=$?"
  grep -E "^(RESULT|PROFILE)" /tmp/i31logs/$name.log
  grep -E "Error|Traceback" /tmp/i31logs/$name.log | head -3
}
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING job A_newcomm 2 --init newcomm --profile /tmp/i31logs/pA
grep -hE "Init COMPLETE|nChannels|comm 0x.*rank 0 nRanks|CC Off|Connected all|P2P Chunksize|threadThresholds" /tmp/i31logs/A_newcomm.log | sort | uniq -c | head -30
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING job B_eager 2 --init eager --profile /tmp/i31logs/pB
grep -hE "Init COMPLETE|nChannels|comm 0x.*rank 0 nRanks|CC Off|Connected all|P2P Chunksize|threadThresholds" /tmp/i31logs/B_eager.log | sort | uniq -c | head -30
job C_newcomm_oursfirst 2 --init newcomm --first ours
job D_plain_lazy 2 --init lazy --plain
job D2_plain_lazy_g1first 2 --init lazy --plain --first g1
job E_lazy_ourseager 2 --init lazy --ours-eager
job F_lazy 2 --init lazy
job A4_newcomm 4 --init newcomm
job B4_eager 4 --init eager
echo "== capture torch's C++ worker replies (NCCL)"
timeout 120 torchrun --nproc_per_node=2 --master-port=$(free_port) scripts/gpu/capture_c10d_nccl.py "$O/cap" > /tmp/i31logs/capture.log 2>&1
echo "capture rc=$?"; grep -vE "Warning|^W1" /tmp/i31logs/capture.log | tail -12
tar czf "$O/logs.tgz" -C /tmp i31logs 2>/dev/null
ls -la "$O" "$O/cap"
