#!/usr/bin/env bash
# Run the h200 profile on a bare lent H200 box (torch/triton/transformers preinstalled, no network).
# Snakemake and papermill travel as wheels in .whl/ (see tools/README.md). Usage, from the repo root:
#   bash tools/h200_run.sh smoke          # a few-minute check that every job runs on CUDA
#   bash tools/h200_run.sh full [TARGET]  # the h200 profile's targets, stage by stage
# Every stage runs under its own time cap; after each stage results/h200 is packed into $OUT so whatever
# finished comes back even if a later stage is cut off.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/minite_out}; mkdir -p "$OUT"
mode=${1:-smoke}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH || echo "wheel install failed"
fi
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
pack() { tar czf "$OUT/results_h200.tgz" results/h200 2>/dev/null; cp -f "$OUT"/stage.log "$OUT"/stage.log 2>/dev/null; }
stage() {  # stage NAME SECONDS CMD...
  local name=$1 cap=$2; shift 2
  local t0=$(date +%s)
  echo "=== stage $name (cap ${cap}s): $*" | tee -a "$OUT/stage.log"
  timeout --signal=INT --kill-after=20 "$cap" "$@" >> "$OUT/stage_$name.log" 2>&1
  local rc=$?
  echo "=== stage $name rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$OUT/stage.log"
  tail -n 25 "$OUT/stage_$name.log"
  pack
}
SMK="python3 -m snakemake --profile workflow/profiles/h200 --scheduler greedy --cores 16 --rerun-incomplete --keep-going"
case "$mode" in
  smoke)
    stage gputests 150 python3 -m pytest -q -x -m gpu tests/
    stage tiny_jobs 120 bash -c "python3 -m minite bench-learner --arm minite_nvfp4 --model tiny --device cuda --steps 2 --warmup 1 --out /tmp/s/bl.json && python3 -m minite diagnose --arm minite_nvfp4 --model tiny --device cuda --attribution off --out /tmp/s/diag && cat /tmp/s/diag/mismatch.json"
    ;;
  full)
    shift; extra=("$@")
    stage throughput 200 $SMK "${extra[@]}" throughput_table
    stage diagnostics 170 $SMK "${extra[@]}" diagnostics
    stage stability 200 $SMK "${extra[@]}" stability
    stage rest 100 $SMK "${extra[@]}" all
    ;;
esac
pack
cat "$OUT/stage.log"
