#!/usr/bin/env bash
# The drift study on a two-H200 machine, in commands of <= 10 minutes that resume each other while the machine
# is kept (checkpoints live on its disk; a fresh machine starts from scratch). From the repo root:
#   bash tools/drift_run.sh calibrate        # SFT warm start + its held-out accuracy (difficulty calibration)
#   bash tools/drift_run.sh study            # the study; run again to resume, until progress says 1000/1000
#   bash tools/drift_run.sh stress           # the predeclared stress setting (only if no arm degraded)
# Snakemake and papermill travel as wheels in .whl/ (tools/README.md). After every stage, results/<profile>
# without weights or checkpoints is packed into $OUT/results_<profile>.tgz, the results table is rebuilt from
# whatever the runs logged so far (unfinished runs included), and the progress of every run is printed.
# Env: CAP (seconds a stage may run, default 540), SET (extra job flags for calibrate, e.g.
# "--set sft.steps=3000 --set task.digits_b=3"), ALT_SET (a second setting calibrated at once on the other GPU).
# calibrate without SET writes the configured warm start to results/drift/sft, where the study then finds it;
# with SET it writes results/drift_calib (never a warm start the study would pick up by mistake).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/minite_out}; mkdir -p "$OUT"
CAP=${CAP:-540}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH || echo "wheel install failed"
fi
python3 -c "import minite.kernels" 2>/dev/null \
  || python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || echo "minite install failed"
python3 -c "import torch; print('torch', torch.__version__, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
RUNS="bf16 naive_te_nvfp4 naive_te_nvfp4_tis minite_nvfp4 bf16_seed1"

pack() {  # pack PROFILE_DIR: small files only (<= 16 MB each come back)
  tar czf "$OUT/results_$(basename "$1").tgz" --exclude='*/ckpt' --exclude='*/weights' --exclude='*/.weights.tmp' \
      --exclude='*.pt' --exclude='*.safetensors' --exclude='*/.lock' "$1" 2>/dev/null
}

progress() {  # progress RESULTS_DIR: steps done, median step time, minutes to 1000 steps; then the table
  python3 - "$1" $RUNS <<'PY'
import json, statistics, sys
from pathlib import Path
root, runs = Path(sys.argv[1]), sys.argv[2:]
for run in runs:
    p = root / run / "stability.jsonl"
    rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []
    if not rows:
        print(f"{run:22s} no steps yet"); continue
    st = statistics.median(r["step_s"] for r in rows)
    last = rows[-1]
    print(f"{run:22s} step {last['step']:5d}/1000  step_s {st:6.2f}  -> {st * (1000 - last['step']) / 60:6.1f} min left"
          f"  reward {last['reward_mean']:.3f}  k3 {last['k3']:.2e}  resp_len {last.get('response_len_median')}"
          f"  held-out {[r['heldout_mean_at_k'] for r in rows if 'heldout_mean_at_k' in r][-1:]}")
PY
  have=$(for r in $RUNS; do [ -s "$1/$r/stability.jsonl" ] && printf '%s ' "$r"; done)
  [ -n "$have" ] && python3 -m minite.report results-table --results "$1" --arms $have --out "$1/results_table" \
      > /dev/null 2>&1 && cat "$1/results_table.md"
  [ -n "$have" ] && python3 -m minite.report figure study --results "$1" --arms $have --smooth 20 \
      --out "$1/figures/drift_study" > /dev/null 2>&1
}

SMK="python3 -m snakemake --profile workflow/profiles/drift"
# GPU memory and utilisation every 30 s while a stage runs (how many runs fit on one GPU: $OUT/gpu_<stage>.csv)
nvidia-smi --query-gpu=timestamp,index,memory.used,memory.total,utilization.gpu --format=csv -l 30 \
  > "$OUT/gpu_${1:-study}.csv" 2>/dev/null &
SMI=$!
trap 'kill $SMI 2>/dev/null' EXIT
case "${1:-study}" in
  calibrate)
    calib() {  # calib DEVICE DIR FLAGS...
      local dev=$1 dir=$2; shift 2
      python3 -m minite sft --model moe64 --rl-config drift --device "$dev" --no-progress --out "$dir/sft" "$@" \
        && python3 -m minite eval --arm bf16 --model moe64 --rl-config drift --device "$dev" --no-progress \
             --checkpoint "$dir/sft" --run "$dir/calibration" --out "$dir/sft_heldout.csv" "$@" \
        && python3 -c "import json,sys; d=json.load(open('$dir/sft/sft.json')); print('$dir', 'SFT', d['steps'], 'steps', round(d['seconds']), 's; teacher-forced expected_acc', round(d['heldout_after']['expected_acc'], 4), '; task', d['task'])" \
        && cat "$dir/sft_heldout.csv"
    }
    dir=results/drift; [ -n "${SET:-}" ] && dir=results/drift_calib
    timeout --signal=INT "$CAP" bash -c "$(declare -f calib); calib cuda:0 $dir ${SET:-}" > "$OUT/calibrate.log" 2>&1 &
    [ -n "${ALT_SET:-}" ] && timeout --signal=INT "$CAP" bash -c "$(declare -f calib); calib cuda:1 results/drift_alt $ALT_SET" \
        > "$OUT/calibrate_alt.log" 2>&1 &
    wait
    tail -n 8 "$OUT"/calibrate*.log
    pack $dir; [ -d results/drift_alt ] && pack results/drift_alt ;;
  study)
    $SMK --unlock > /dev/null 2>&1      # a lock left by a segment cut at its time cap
    timeout --signal=INT --kill-after=20 "$CAP" $SMK drift_study > "$OUT/study.log" 2>&1; echo "snakemake rc=$?"
    tail -n 15 "$OUT/study.log"; progress results/drift; pack results/drift ;;
  stress)
    $SMK --unlock --configfile workflow/profiles/drift/stress.yaml > /dev/null 2>&1
    timeout --signal=INT --kill-after=20 "$CAP" $SMK drift_study --configfile workflow/profiles/drift/stress.yaml \
        > "$OUT/stress.log" 2>&1; echo "snakemake rc=$?"
    tail -n 15 "$OUT/stress.log"; progress results/drift_stress; pack results/drift_stress ;;
  *) echo "unknown stage $1 (calibrate | study | stress)"; exit 2 ;;
esac
