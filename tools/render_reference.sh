#!/usr/bin/env bash
# Re-render a reference run's tables, figures and notebooks from its own data (after the plotting code
# changed), the same commands the pipeline's render rules run; nothing is measured again:
#   bash tools/render_reference.sh cpu        # results/reference/cpu
# The arms and the smoothing window come from workflow/profiles/<profile>/pipeline.yaml.
set -euo pipefail
profile=${1:?usage: tools/render_reference.sh PROFILE}
R=results/reference/$profile
[ -d "$R" ] || { echo "no reference run at $R" >&2; exit 2; }
read -r arms smooth < <(python3 -c "import yaml; c = yaml.safe_load(open('workflow/profiles/$profile/pipeline.yaml'))
print(','.join(c['arms']), c.get('smooth', 5))")
A=${arms//,/ }
mkdir -p "$R/logs/figures" "$R/logs/notebooks"
report() { local log=$1; shift; python3 -m minite.report "$@" > "$R/logs/$log.log" 2>&1 || { cat "$R/logs/$log.log"; exit 1; }; }
report throughput_table table --results "$R" --arms $A --profile "$profile" --out "$R/throughput_table"
report figures/throughput figure throughput --results "$R" --arms $A --out "$R/figures/throughput"
report figures/drift figure drift --results "$R" --arms $A --smooth "$smooth" --out "$R/figures/drift"
report figures/reward_eval figure reward --results "$R" --arms $A --smooth "$smooth" --out "$R/figures/reward_eval"
report figures/layers figure layers --results "$R" --arms $A --out "$R/figures/layers"
report figures/attribution figure attribution --results "$R" --arms $A --out "$R/figures/attribution"
if [ -f "$R/kernels.csv" ]; then report figures/kernels figure kernels --results "$R" --out "$R/figures/kernels"; fi
for nb in drift throughput diagnostics; do
  python3 -m papermill "notebooks/$nb.ipynb" "$R/notebooks/$nb.ipynb" -k python3 -p results_dir "$R" \
      -p reference_dir "$R" -y "arms: [${arms//,/, }]" --no-progress-bar > "$R/logs/notebooks/$nb.log" 2>&1 \
      || { cat "$R/logs/notebooks/$nb.log"; exit 1; }
done
echo "re-rendered $R"
