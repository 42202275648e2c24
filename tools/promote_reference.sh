#!/usr/bin/env bash
# Make a finished run the committed reference of its profile:
#   bash tools/promote_reference.sh h200 [results/h200]
# copies the run (default results/<profile>, or an unpacked results_<profile>.tgz) to
# results/reference/<profile>/, replacing what was there, without weights, checkpoints or lock files, and
# lists any file whose provenance sha is not a clean commit. Then write results/reference/<profile>/PROVENANCE.md
# (commands, commits, dates) and commit.
set -euo pipefail
profile=${1:?usage: tools/promote_reference.sh PROFILE [RUN_DIR]}
src=${2:-results/$profile}
dst=results/reference/$profile
[ -d "$src" ] || { echo "no run at $src" >&2; exit 2; }
rm -rf "$dst.new" && mkdir -p "$dst.new"
tar cf - -C "$src" --exclude='./*/ckpt' --exclude='./sft/weights' --exclude='./sft/.weights.tmp' \
    --exclude='*.pt' --exclude='*.safetensors' --exclude='*/.lock' --exclude='.snakemake' . | tar xf - -C "$dst.new"
rm -rf "$dst" && mv "$dst.new" "$dst"
echo "copied $src -> $dst ($(find "$dst" -type f | wc -l) files)"
dirty=$(grep -rl --include='*.json' --include='*.jsonl' --include='*.csv' -e '[0-9a-f]-dirty' "$dst" || true)
[ -z "$dirty" ] || { echo "files measured by a modified tree (sha ...-dirty):"; echo "$dirty"; }
