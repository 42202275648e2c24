#!/usr/bin/env bash
# Run the h200 profile on a bare lent H200 box (torch/triton/transformers preinstalled, no network).
# Snakemake and papermill travel as wheels in .whl/ (see tools/README.md). Usage, from the repo root:
#   bash tools/h200_run.sh gputests tiny throughput diagnostics stability all
# (stages run in the order given; SMK_EXTRA adds snakemake options, e.g. "--configfile tools/h200_session.yaml";
#  CAP_<stage>=SECONDS overrides a stage's time cap; `main` = diagnostics + stability + evals in one
#  snakemake call, so that with --resources gpu=N their GPU jobs run side by side)
# Every stage runs under its own time cap; after each stage results/h200 is packed into $OUT so whatever
# finished comes back even if a later stage is cut off.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/minite_out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH || echo "wheel install failed"
fi
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
# Only what the repo keeps travels back (<= 16 MB a file): never the SFT weights or RL checkpoints (GBs).
pack() { tar czf "$OUT/results_h200.tgz" --exclude='*/ckpt' --exclude='*/weights' --exclude='*/.weights.tmp' \
           --exclude='*.pt' --exclude='*.safetensors' --exclude='*/.lock' results/h200 2>/dev/null; }
stage() {  # stage NAME SECONDS CMD...
  local name=$1 cap=$2; shift 2
  local override="CAP_$name"; cap=${!override:-$cap}
  local t0=$(date +%s)
  echo "=== stage $name (cap ${cap}s): $*" | tee -a "$OUT/stage.log"
  timeout --signal=INT --kill-after=20 "$cap" "$@" >> "$OUT/stage_$name.log" 2>&1
  local rc=$?
  echo "=== stage $name rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$OUT/stage.log"
  tail -n 25 "$OUT/stage_$name.log"
  pack
}
SMK="python3 -m snakemake --profile workflow/profiles/h200 --scheduler greedy --cores 16 --rerun-incomplete --keep-going"
for st in "$@"; do
  case "$st" in
    gputests)    stage gputests 90 python3 -m pytest -q -x -m gpu tests/ ;;
    tiny)        stage tiny 70 bash -c "python3 -m minite bench-learner --arm minite_nvfp4 --model tiny --device cuda --steps 2 --warmup 1 --out /tmp/s/bl.json && python3 -m minite diagnose --arm minite_nvfp4 --model tiny --device cuda --attribution off --out /tmp/s/diag && cat /tmp/s/diag/mismatch.json" ;;
    throughput)  stage throughput 210 $SMK throughput_table ${SMK_EXTRA:-} ;;
    sft)         stage sft 80 $SMK results/h200/sft/sft.json ${SMK_EXTRA:-} ;;
    diag_ab)     stage diag_ab 60 $SMK results/h200/minite_nvfp4/diagnostics/mismatch.json results/h200/bf16/diagnostics/mismatch.json ${SMK_EXTRA:-} ;;
    diagnostics) stage diagnostics 110 $SMK diagnostics ${SMK_EXTRA:-} ;;
    stability)   stage stability 170 $SMK stability ${SMK_EXTRA:-} ;;
    evals)       stage evals 55 $SMK evals ${SMK_EXTRA:-} ;;
    main)        stage main 420 $SMK diagnostics stability evals ${SMK_EXTRA:-} ;;
    all)         stage all 120 $SMK all ${SMK_EXTRA:-} ;;
    *) echo "unknown stage $st" ;;
  esac
done
pack
cat "$OUT/stage.log"
