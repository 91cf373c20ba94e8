#!/usr/bin/env bash
# One command on the lent GPU machine: install the carried wheels, then run.py's steps.
#
#   MHAR_COMMIT=<short hash> experiments/eight_b/run_on_gpu.sh OUT STEP... [run.py options]
#
# Everything is built under /tmp/eight-b (a fresh machine has nothing from an earlier command).
# OUT gets machine.txt (GPU, disk, memory, versions), run.log (the whole output) and the rows,
# eight_b_{convert,verify,train,generate}.jsonl, to append to benchmarks/results/. Pieces that
# would end later than $MINUTES (default 9.3) after the start are skipped and named at the end.
set -uo pipefail
out=$1
shift
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
start=$(date +%s)
mkdir -p "$out"
if [ -z "${MHAR_COMMIT:-}" ]; then
    MHAR_COMMIT=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null) || {
        echo "set MHAR_COMMIT to the commit being run (rows name it)" >&2; exit 2; }
fi
export MHAR_COMMIT
if [ "${SKIP_WHEELS:-0}" != 1 ]; then  # SKIP_WHEELS=1: the packages are there already (a dry run on a CPU)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$repo"/.whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$repo PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    HF_DATASETS_CACHE=/tmp/eight-b/datasets-cache HF_DATASETS_DISABLE_PROGRESS_BARS=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    df -h /tmp
    free -g
    nproc
    python3 -c "import torch, transformers, peft, accelerate, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__, 'triton', triton.__version__)"
    python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 | tail -1
    echo "commit $MHAR_COMMIT"
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
minutes=$(python3 -c "print(${MINUTES:-9.3} - ($(date +%s) - $start) / 60)")
python3 "$here/run.py" --work /tmp/eight-b --results "$out" --deadline-minutes "$minutes" "$@" 2>&1 | tee "$out/run.log"
