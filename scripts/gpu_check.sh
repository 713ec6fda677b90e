#!/usr/bin/env bash
# The GPU check of the peak probe against the CUDA allocator, one script, at most ~8 minutes on a machine with one GPU:
#   scripts/gpu_check.sh [OUT_DIR]
# One world-1 job per framework on CUDA (the tiny Llama; Megatron with its local spec: no TransformerEngine),
# one llama3_1b-shaped torchtitan job at seq 1024, then llama3_1b at seq 8192 and 4096 with each
# activation checkpointing (none / selective / full), all world 1, 3 steps. Then per job / rank / step:
# the ledger's peak, the peak probe's (exact and in the CUDA allocator's 512-byte blocks) and
# torch.cuda.max_memory_allocated() after the probe's per-step reset (python -m analysis.gpu_check), and
# the reconcile table of resident state and peak. Each step of a record holds the allocator's peaks
# (allocated_bytes.all.peak = max_memory_allocated, reserved_bytes.all.peak = max_memory_reserved),
# num_alloc_retries / num_ooms, and device_used_bytes (total - free of torch.cuda.mem_get_info() at the
# step's end): probes/memory.py cuda_stats.
#
# Python: $PYTHON if set, else .venv/bin/python if there is one, else the first of python3.12, python3,
# python on PATH that imports torch. Any Python but .venv's runs with the kit (KIT=gpu_kit, built by
# scripts/gpu_kit.sh and carried to the GPU machine, whose Python has torch and nothing of ours): its
# site.tar.gz is unpacked into KIT/site, and
# KIT/site_stubs and KIT/site go first on PYTHONPATH (the ranks, started as `python -m
# launchers.worker`, inherit it). The kit carries extension modules built for one CPython (KIT/kit.env
# KIT_NEEDS_PYTHON, 3.12): another Python is refused before any job.
# The tables need pandas: where the kit's Python has none (the kit stubs it), they are printed as
# commands to run on OUT_DIR with .venv afterwards.
#
# Not run on the development machine (no GPU there): no GPU figure is claimed from it.
# GPU_CHECK_DEVICE=cpu runs the same jobs on gloo CPU ranks (cluster.fork_ranks=false: each rank a
# `python -m launchers.worker` process, as on CUDA), to try this script and its kit without a GPU
# (tests/test_gpu_kit.py); GPU_CHECK_JOBS="NAME ..." (glob patterns) runs only those jobs;
# GPU_CHECK_BUDGET_S (default 400): no job starts later than this many seconds into the script.
set -u
cd "$(dirname "$0")/.."
# GPU_CHECK_LIST=1: print each job's name and launch.py overrides, one line each, and run nothing (what
# tests/test_peak.py validates: a GPU machine's minutes are not lost to a config typo)
LIST=${GPU_CHECK_LIST:-}
OUT=${1:-outputs/gpu_check}
KIT=${KIT:-gpu_kit}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
JOBS=${GPU_CHECK_JOBS:-*}
BUDGET=${GPU_CHECK_BUDGET_S:-400}
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else  # the first Python on PATH that has torch (the kit needs 3.12: that one first)
    PY=
    for c in python3.12 python3 python; do
        if command -v "$c" >/dev/null && "$c" -c 'import torch' 2>/dev/null; then PY=$(command -v "$c"); break; fi
    done
    [ -n "$PY" ] || PY=$(command -v python3 || command -v python) || { echo "gpu_check: no python on PATH" >&2; exit 3; }
fi
mkdir -p "$OUT"
[ -n "$LIST" ] || echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)' 2>&1)), $(uname -m)"

ANALYSIS_PATH=${PYTHONPATH:-}
if [ -z "$LIST" ] && [ "$PY" != .venv/bin/python ]; then  # the device: the kit, or nothing runs
    if [ ! -f "$KIT/kit.env" ] || [ ! -f "$KIT/site.tar.gz" ]; then
        echo "gpu_check: no kit at $KIT (KIT=...): build it with scripts/gpu_kit.sh and carry it" >&2
        exit 3
    fi
    # shellcheck disable=SC1091
    . "$KIT/kit.env"
    pyv=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ -n "$KIT_NEEDS_PYTHON" ] && [ "$pyv" != "$KIT_NEEDS_PYTHON" ]; then
        echo "gpu_check: refused: this Python is $pyv, the kit at $KIT carries extension modules built for" \
             "CPython $KIT_NEEDS_PYTHON alone (numpy, pydantic-core...; $KIT/MANIFEST 'so$KIT_NEEDS_PYTHON'):" \
             "run with PYTHON=<a python$KIT_NEEDS_PYTHON with torch>" >&2
        exit 3
    fi
    if [ "$(uname -m)" != "$KIT_MACHINE" ]; then
        echo "gpu_check: refused: this machine is $(uname -m), the kit was built on $KIT_MACHINE" >&2
        exit 3
    fi
    KIT=$(cd "$KIT" && pwd)
    if [ ! -f "$KIT/site/.unpacked" ] || [ "$KIT/site.tar.gz" -nt "$KIT/site/.unpacked" ]; then
        rm -rf "$KIT/site"
        tar xzf "$KIT/site.tar.gz" -C "$KIT" 2>/dev/null \
            || "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$KIT/site.tar.gz" "$KIT" \
            || { echo "gpu_check: cannot unpack $KIT/site.tar.gz" >&2; exit 3; }
        touch "$KIT/site/.unpacked"
    fi
    echo "kit: $KIT ($(du -sh "$KIT/site.tar.gz" | cut -f1) packed, $(du -sh "$KIT/site" | cut -f1) unpacked; Python $KIT_PYTHON)"
    ANALYSIS_PATH="$KIT/site${PYTHONPATH:+:$PYTHONPATH}"  # no stubs: the tables need the real pandas
    export PYTHONPATH="$KIT/site_stubs:$KIT/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONNOUSERSITE=1
fi
if [ -z "$LIST" ]; then
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
# what torch.compile's kernels (titan's FlexAttention) need at run time: triton builds its launcher
# with a C compiler against Python.h
echo "C compiler: $(command -v "${CC:-cc}" || command -v gcc || echo none); Python.h:" \
     "$("$PY" -c 'import os, sysconfig; p = os.path.join(sysconfig.get_paths()["include"], "Python.h"); print(p if os.path.exists(p) else "none")')"
fi

if [ "$DEVICE" = cpu ]; then
    CLUSTER=(cluster.device=cpu cluster.backend=gloo cluster.fork_ranks=false)
else
    CLUSTER=(cluster.device=cuda cluster.backend=nccl)
fi
T0=$SECONDS
job() {  # job NAME SECONDS OVERRIDES...: one world-1 job; its output in OUT/NAME.log
    local name=$1 limit=$2 pat pats wanted=
    shift 2
    read -ra pats <<<"$JOBS"  # not globbed against this folder's files
    for pat in "${pats[@]}"; do
        # shellcheck disable=SC2053
        [[ $name == $pat ]] && wanted=1
    done
    [ -n "$wanted" ] || return 0
    if ((SECONDS - T0 > BUDGET)); then
        echo "$name: skipped (${BUDGET} s budget spent)"
        return 0
    fi
    if [ -n "$LIST" ]; then
        echo "$name ${CLUSTER[*]} cluster.ranks=1 train.steps=3 $*"
        return 0
    fi
    local t0=$SECONDS
    timeout "$limit" "$PY" launch.py "${CLUSTER[@]}" cluster.ranks=1 train.steps=3 \
        wandb.mode=disabled "hydra.run.dir=$OUT/$name" "$@" >"$OUT/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s"
}

job megatron 120 framework=megatron framework.transformer_impl=local
job deepspeed-z3 120 framework=deepspeed framework.zero_stage=3
job titan 180 framework=titan  # the first FlexAttention compile (later jobs reuse inductor's cache)
job titan-llama3_1b 150 framework=titan model=llama3_1b model.seq_len=1024 layout.global_batch_size=1
for seq in 8192 4096; do
    for ac in none selective full; do
        job "titan-llama3_1b-s$seq-$ac" 120 framework=titan model=llama3_1b model.seq_len=$seq \
            framework.activation_checkpoint=$ac layout.global_batch_size=1
    done
done
[ -z "$LIST" ] || exit 0
echo "jobs: $((SECONDS - T0)) s"

if PYTHONPATH=$ANALYSIS_PATH "$PY" -c 'import pandas' 2>/dev/null; then
    PYTHONPATH=$ANALYSIS_PATH "$PY" -m analysis.gpu_check "$OUT"
    PYTHONPATH=$ANALYSIS_PATH "$PY" -m analysis.reconcile "$OUT"
else
    echo "no pandas here: the tables, from $OUT with .venv: .venv/bin/python -m analysis.gpu_check DIR;" \
         ".venv/bin/python -m analysis.reconcile DIR"
fi
