"""minite jobs: the steps the Snakemake pipeline runs, each also a command (python -m minite JOB --help).

Each job lives in ``minite/jobs/<module>.py`` with ``add_args(parser)`` and ``run(args) -> int``; they are
imported only when chosen, so ``--help`` stays fast and a missing optional backend fails only its job. Flags
shared by several jobs are ``minite.jobs.common``. Bad input ends a job with one line on stderr and exit
status 2; progress and summaries are logged (INFO) to stderr, results go to files.

Several GPUs: ``torchrun --nproc-per-node N -m minite <job> ...`` runs a job whose module says
``DISTRIBUTED = True`` as N processes (``minite.distributed``); rank 0 logs and writes, the others log
warnings only. Other jobs refuse torchrun.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from minite import distributed
from minite.jobs import common

log = logging.getLogger("minite")

# job name -> (module under minite.jobs, one-line help)
JOBS = {
    "bench-learner": ("bench_learner", "learner throughput: tokens/s of complete learner updates"),
    "bench-sampler": ("bench_sampler", "rollout throughput: decode tokens/s against the weights' bandwidth roofline"),
    "diagnose": ("diagnose", "trainer/sampler mismatch, per-layer localisation, cause attribution"),
    "sft": ("sft", "SFT warm start on the synthetic task (cached; shared by all arms)"),
    "rl": ("rl", "long-horizon GRPO stability run (checkpoints, resumable)"),
    "eval": ("evaluate", "held-out mean@k accuracy with the sampler engine"),
    "kernel-bench": ("kernel_bench", "check and time the NVFP4 kernels (GPU)"),
    "export-modelopt": ("export_modelopt", "write a ModelOpt-NVFP4 checkpoint that vLLM loads"),
}

# What a user can fix, reported in one line (exit 2) instead of a traceback: bad input (ValueError: arm,
# model, task and RL configs, flag values), missing input files and other OS errors (a place that cannot be
# written), missing optional packages (the message says what to install), and refusals of the environment
# (RuntimeError: no CUDA device, a run directory that another process writes or another run owns).
# MINITE_LOG_LEVEL=DEBUG adds the traceback.
USER_ERRORS = (ValueError, OSError, ImportError, RuntimeError)


def configure_logging() -> None:
    """minite's records at INFO (or MINITE_LOG_LEVEL) to stderr, one plain line each. Where the host
    application configured logging already, its handlers stay (``basicConfig`` does nothing then)."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    level = os.environ.get("MINITE_LOG_LEVEL", "INFO").upper()
    log.setLevel(level if level in logging.getLevelNamesMapping() else logging.INFO)


def build_parser(load_jobs: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minite", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="job", metavar="JOB")
    for name, (module, help_) in JOBS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if load_jobs == name:
            importlib.import_module(f"minite.jobs.{module}").add_args(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    job = next((a for a in argv if not a.startswith("-")), None)
    if job is not None and job not in JOBS:
        build_parser().error(f"unknown job {job!r}; choose from {', '.join(JOBS)}")
    args = build_parser(load_jobs=job).parse_args(argv)
    if args.job is None:
        build_parser().print_help()
        return 2
    module = importlib.import_module(f"minite.jobs.{JOBS[args.job][0]}")
    try:
        if distributed.launched() and not getattr(module, "DISTRIBUTED", False):
            raise RuntimeError(f"{args.job} runs in one process: launch it without torchrun "
                               "(or with --nproc-per-node 1)")
        common.check_outputs(args)  # before any work: a bad --out would otherwise fail only at the end
        if distributed.launched():
            distributed.init()
            if not distributed.is_main():
                log.setLevel(logging.WARNING)
                args.no_progress = True
        return int(module.run(args) or 0)
    except USER_ERRORS as e:
        log.error("%s: %s", args.job, e)
        log.debug("traceback", exc_info=True)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: a traceback from wherever the job was adds nothing
        resume = "; rerun the same command to resume" if getattr(module, "RESUMES", False) else ""
        log.error("%s: interrupted%s", args.job, resume)
        log.debug("traceback", exc_info=True)
        return 130
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
