"""``python -m minite.report table|figure ...``: render tables and figures from a results directory.

    python -m minite.report table  --results results/cpu --arms bf16 naive_te_nvfp4 minite_nvfp4 \
        [--reference results/reference/cpu]
    python -m minite.report figure throughput --results results/cpu --arms ... --out results/cpu/figures/throughput
    python -m minite.report figure layers --results results/cpu --arms ... --out results/cpu/figures/layers
    python -m minite.report figure {drift,reward,kernels,attribution,study} ...
    python -m minite.report results-table --results results/drift --arms bf16 bf16_seed1 naive_te_nvfp4 ...
    python -m minite.report run-rounds --results results/h200 --plan "bf16:0 minite_nvfp4:0 ..." \
        --runner "python -m minite" --args "--model qwen3_30b_a3b ..."
    python -m minite.report merge-rounds --results results/h200 --arms ... --rounds 3
    (run-rounds / merge-rounds --bench sampler: bench-sampler's rollout records, rollout_rounds/ -> rollout.json)
(--arms: run directories, an arm or <arm>_seed<N>, for the RL tables and figures)

The committed reference runs (results/reference/<profile>) render the same way: ``--results`` may name one.
"""
from __future__ import annotations

import argparse
import sys

from minite.report import figures, load, tables

FIGURES = ("throughput", "drift", "reward", "kernels", "layers", "attribution", "study")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minite.report", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("table", help="throughput_table.{csv,md,tex} from <results>/<arm>/learner.json")
    f = sub.add_parser("figure", help="one figure as <out>.png and <out>.pdf")
    f.add_argument("name", choices=FIGURES)
    r = sub.add_parser("results-table", help="results_table.{csv,md,tex}: accuracy and stability per arm, seeds "
                                             "pooled, from <results>/<run>/stability.jsonl (+ summaries, evals)")
    r.add_argument("--profile", help="profile name shown in the markdown (default: the results dir name)")
    rr = sub.add_parser("run-rounds", help="run bench-learner (bench-sampler) per (arm, round) of --plan into "
                                           "<results>/<arm>/learner_rounds/ (rollout_rounds/), keeping whole "
                                           "rounds an interrupted attempt finished")
    rr.add_argument("--results", required=True, help="the profile's results directory, results/<profile>")
    rr.add_argument("--plan", required=True, help="'ARM:ROUND ...' in run order")
    rr.add_argument("--runner", required=True, help="the command that runs minite's CLI, e.g. 'python -m minite'")
    rr.add_argument("--args", default="", help="the bench's arguments besides --arm and --out (one string)")
    m = sub.add_parser("merge-rounds", help="<results>/<arm>/learner.json (rollout.json) from the arm's "
                                            "learner_rounds/round<k>.json (rollout_rounds/): minite.report.rounds")
    m.add_argument("--results", required=True, help="the profile's results directory, results/<profile>")
    m.add_argument("--arms", nargs="+", required=True, help="the arms measured in the rounds")
    m.add_argument("--rounds", type=int, required=True, help="how many rounds were run")
    for q in (rr, m):
        q.add_argument("--bench", choices=["learner", "sampler"], default="learner",
                       help="bench-learner's records (default) or bench-sampler's")
    for q in (t, f, r):
        q.add_argument("--results", required=True, help="the profile's results directory, results/<profile>")
        q.add_argument("--arms", nargs="+", default=[], help="arms, in display order")
        q.add_argument("--out", help="output prefix (table) / stem (figure: writes <out>.png and <out>.pdf; "
                                     "layers: <out>_<arm>.png and .pdf per arm)")
    t.add_argument("--profile", help="profile name shown in the markdown (default: the results dir name)")
    t.add_argument("--reference", help="a reference run of the same profile (results/reference/<profile>) to "
                                       "set beside this one in the markdown, labelled with its provenance")
    f.add_argument("--smooth", type=int, default=5, help="rolling-mean window over RL steps")
    f.add_argument("--no-evals", action="store_true", help="reward figure without the eval panel")
    return p


def main(argv=None) -> int:
    """Missing or unreadable result files and bad arguments end in one line on stderr and exit status 2."""
    a = build_parser().parse_args(argv)
    try:
        return _run(a)
    except (ValueError, OSError) as e:  # ResultError is a ValueError
        print(f"python -m minite.report {a.what}: error: {e}", file=sys.stderr)
        return 2


def _run(a) -> int:
    if a.what == "table":
        df = tables.write_throughput_table(a.results, a.arms, a.out, a.profile, a.reference)
        print(df.to_string(index=False))
        return 0
    if a.what == "run-rounds":
        import shlex

        from minite.report.rounds import BENCHES, parse_plan, run_rounds
        return run_rounds(a.results, parse_plan(a.plan), shlex.split(a.runner), shlex.split(a.args),
                          BENCHES[a.bench])
    if a.what == "merge-rounds":
        from minite.report.rounds import BENCHES, drop_partial, write_merged
        bench = BENCHES[a.bench]
        for arm, rec in write_merged(a.results, a.arms, a.rounds, bench).items():
            print(f"{arm}: {rec[bench.rate]:,.0f} tokens/s (round {rec['median_round']}, the median of {a.rounds}: "
                  + ", ".join(f"{r['tokens_per_s']:,.0f}" for r in rec["rounds"]) + ")")
        drop_partial(a.results, bench)
        return 0
    if a.what == "results-table":
        from minite.report.results_table import write_results_table
        if not a.arms:
            raise ValueError("results-table needs --arms")
        print(write_results_table(a.results, a.arms, a.out, a.profile).to_string(index=False))
        return 0
    if not a.out:
        raise ValueError("--out is required for figures")
    if a.name != "kernels" and not a.arms:
        raise ValueError(f"figure {a.name} needs --arms")
    if a.name == "throughput":
        learner, rollout = load.load_learner(a.results, a.arms), load.load_rollout(a.results, a.arms)
        figures.throughput_bars(tables.throughput_table(learner, rollout), a.out,  # both runs' sha in the footer
                                footer=figures.footer_from([*learner.values(), *rollout.values()]))
    elif a.name == "drift":
        figures.drift(load.load_stability(a.results, a.arms), a.out,
                      load.load_stability_summary(a.results, a.arms, missing="skip"), smooth=a.smooth)
    elif a.name == "reward":
        evals = None if a.no_evals else load.load_evals(a.results, a.arms)
        figures.reward_eval(load.load_stability(a.results, a.arms), evals, a.out, smooth=a.smooth)
    elif a.name == "kernels":
        figures.kernel_throughput(load.load_kernels(a.results), a.out)
    elif a.name == "study":
        figures.drift_study(load.load_stability(a.results, a.arms), load.load_heldout(a.results, a.arms), a.out,
                            smooth=a.smooth, summaries=load.load_stability_summary(a.results, a.arms, missing="skip"))
    else:
        from minite.report import diagnostics
        diag = load.load_diagnostics(a.results, a.arms)
        if a.name == "attribution":
            diagnostics.attribution(diag, a.out)
        else:  # <out>_<arm>.png/.pdf for every arm, on one colour scale
            diagnostics.layers(diag, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
