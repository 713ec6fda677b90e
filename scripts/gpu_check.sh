#!/usr/bin/env bash
# The GPU check of the peak probe against the CUDA allocator, one script, at most ~8 minutes on a machine with one GPU:
#   scripts/gpu_check.sh [OUT_DIR]        (PYTHON=... to use another interpreter than .venv's)
# One world-1 job per framework on CUDA (the tiny Llama) and one llama3_1b-shaped torchtitan job that
# fits one GPU, then per job / rank / step: the ledger's peak, the peak probe's (exact and in the CUDA
# allocator's 512-byte blocks) and torch.cuda.max_memory_allocated() after the probe's per-step reset
# (python -m analysis.gpu_check), and the reconcile table of resident state and peak.
# Not run on the development machine (no GPU there): no GPU figure is claimed from it.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_check}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: none"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'

job() {  # job NAME SECONDS OVERRIDES...: one world-1 CUDA job; its output in OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$PY" launch.py cluster.device=cuda cluster.backend=nccl cluster.ranks=1 train.steps=3 \
        wandb.mode=disabled "hydra.run.dir=$OUT/$name" "$@" >"$OUT/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s"
}

job megatron 90 framework=megatron
job deepspeed-z3 90 framework=deepspeed framework.zero_stage=3
job titan 90 framework=titan
job titan-llama3_1b 180 framework=titan model=llama3_1b model.seq_len=1024 layout.global_batch_size=1

"$PY" -m analysis.gpu_check "$OUT"
"$PY" -m analysis.reconcile "$OUT"
