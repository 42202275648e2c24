"""``python -m minite kernel-bench``: check and time the NVFP4 kernels on the GPU (minite.kernels.bench)."""
from __future__ import annotations

from minite.jobs import common


def add_args(parser) -> None:
    from minite.kernels import bench
    bench.add_args(parser)
    common.declare_out(parser, "file")


def run(args) -> int:
    from pathlib import Path

    import torch

    from minite.kernels import bench
    from minite.provenance import provenance, write_csv, write_text
    bench.check_args(args)  # before the provenance (git) and the default --out
    out = Path(args.out or bench.default_out(args))

    def publish(df, summary_md):
        write_csv(out, df)
        write_text(out.with_suffix(".md"), summary_md)
    return bench.run(args, provenance(torch.device("cuda" if torch.cuda.is_available() else "cpu")), publish)
