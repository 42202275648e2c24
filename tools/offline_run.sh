#!/usr/bin/env bash
# Run the pipeline on a GPU node without network access (tools/README.md). From the repository root:
#   bash tools/offline_run.sh install gputests smoke throughput main all
# Stages run in the order given, each under a time cap (CAP_<stage>=SECONDS overrides it). After every stage
# results/$PROFILE is packed into $OUT/results_$PROFILE.tgz (never weights or checkpoints), so whatever
# finished comes back even if a later stage is cut off.
#   PROFILE    workflow/profiles/<PROFILE> (default h200)
#   OUT        where the logs and the packed results go (default /tmp/minite_out)
#   SMK_EXTRA  more snakemake options, e.g. "--configfile tools/h200_segment1.yaml --resources gpu=6"
#   CORES      snakemake --cores (default: all)
#   PY         the Python that has the node's PyTorch (default python3)
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PROFILE=${PROFILE:-h200}
OUT=${OUT:-/tmp/minite_out}
mkdir -p "$OUT"
PY=${PY:-python3}
RESULTS=results/$PROFILE

install() {  # the wheels carried in .whl/ (snakemake, papermill, ...), then minite itself, all without network
  if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || return 1
  fi
  $PY -m pip install -q --no-deps --no-build-isolation -e . || return 1
  $PY -c "import torch, triton, transformers, snakemake, minite
print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__,
      '| snakemake', snakemake.__version__, '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
}

pack() {  # only what a results tree keeps travels back: never the SFT weights or RL checkpoints (GBs)
  [ -d "$RESULTS" ] || return 0
  tar czf "$OUT/results_$PROFILE.tgz" --exclude='*/ckpt' --exclude='*/weights' --exclude='*/.weights.tmp' \
      --exclude='*.pt' --exclude='*.safetensors' --exclude='*/.lock' "$RESULTS" 2>/dev/null
}

stage() {  # stage NAME SECONDS CMD...
  local name=$1 cap=$2; shift 2
  local override="CAP_$name"; cap=${!override:-$cap}
  local t0; t0=$(date +%s)
  echo "=== stage $name (cap ${cap}s): $*" | tee -a "$OUT/stage.log"
  if declare -F "$1" > /dev/null; then  # a function of this script: timeout runs programs, so through bash
    export -f "$1"; export PY
    timeout --signal=INT --kill-after=20 "$cap" bash -c '"$@"' bash "$@" >> "$OUT/stage_$name.log" 2>&1
  else
    timeout --signal=INT --kill-after=20 "$cap" "$@" >> "$OUT/stage_$name.log" 2>&1
  fi
  local rc=$?
  echo "=== stage $name rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$OUT/stage.log"
  tail -n 25 "$OUT/stage_$name.log"
  pack
}

# --scheduler greedy: the default ILP scheduler needs pulp, one wheel fewer to carry
SMK="$PY -m snakemake --profile workflow/profiles/$PROFILE --scheduler greedy --cores ${CORES:-all} --keep-going"
for st in "$@"; do
  case "$st" in
    install)     stage install 300 install ;;
    gputests)    stage gputests 480 $PY -m pytest -q -m gpu tests/ ;;   # H200: ~4 min, the CUDA decode GEMM build included
    smoke)       stage smoke 90 bash -c "$PY -m minite bench-learner --arm minite_nvfp4 --model tiny --device cuda --steps 3 --warmup 1 --out /tmp/minite_smoke/learner.json && $PY -m minite diagnose --arm minite_nvfp4 --model tiny --device cuda --attribution off --out /tmp/minite_smoke/diagnostics" ;;
    throughput)  stage throughput 900 $SMK throughput_table ${SMK_EXTRA:-} ;;   # h200: 3 rounds x 3 arms of bench-learner and of bench-sampler (a cut-off job resumes by whole rounds)
    kernels)     stage kernels 300 $SMK kernel_bench ${SMK_EXTRA:-} ;;
    sft)         stage sft 120 $SMK "$RESULTS/sft/sft.json" ${SMK_EXTRA:-} ;;
    diagnostics) stage diagnostics 180 $SMK diagnostics ${SMK_EXTRA:-} ;;
    stability)   stage stability 300 $SMK stability ${SMK_EXTRA:-} ;;
    evals)       stage evals 120 $SMK evals ${SMK_EXTRA:-} ;;
    main)        stage main 480 $SMK diagnostics stability evals ${SMK_EXTRA:-} ;;
    all)         stage all 300 $SMK all ${SMK_EXTRA:-} ;;
    *) echo "unknown stage $st (install gputests smoke throughput kernels sft diagnostics stability evals main all)" ;;
  esac
done
pack
cat "$OUT/stage.log"
