"""``python -m minite kernel-bench``: check and time the NVFP4 kernels on the GPU (minite.kernels.bench)."""
from __future__ import annotations


def add_args(parser) -> None:
    from minite.kernels import bench
    bench.add_args(parser)


def run(args) -> int:
    from minite.kernels import bench
    return bench.run(args)
