"""torch.distributed for minite's jobs: one process per GPU under torchrun, or one process alone.

A job launched by torchrun (``torchrun --standalone --nproc-per-node N -m minite <job> ...``; several nodes:
torchrun's rendezvous flags, docs/PIPELINE.md) finds ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` in its
environment. ``init()`` then starts the default process group — NCCL on CUDA, gloo on CPU, so the CPU tests
run the same distributed code — and pins the process to GPU ``LOCAL_RANK``. Without torchrun (or with one
process) nothing is started and every helper here answers as a world of one, so single-process code paths
stay exactly what they were.

torchrun starts its workers in sessions of their own, so a ``kill -9`` of the launcher would leave them
running and writing; ``init()`` asks Linux to kill each worker when its launcher dies (``PR_SET_PDEATHSIG``).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def launched() -> bool:
    """Whether this process is one of several started by torchrun (``WORLD_SIZE`` > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def active() -> bool:
    """Whether a process group of more than one process is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def is_main() -> bool:
    """Rank 0 (or the only process): the one that writes results."""
    return rank() == 0


def init() -> None:
    """Start the default process group from torchrun's environment (idempotent; a no-op without torchrun)."""
    if not launched() or (dist.is_available() and dist.is_initialized()):
        return
    _die_with_launcher()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    log.debug("rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), dist.get_backend())


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _die_with_launcher() -> None:
    """SIGKILL this worker when its parent (the torchrun agent) dies, however it dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))          # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:                      # the launcher died before prctl took effect
        os._exit(1)


def collective_device() -> torch.device:
    """Where collectives put their tensors: the current GPU with NCCL, the CPU with gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")


# ------------------------------------------------------------------------------------------ collectives
def barrier() -> None:
    if active():
        dist.barrier()


def all_reduce(values, op: str = "sum") -> torch.Tensor:
    """Element-wise sum / max / min over ranks of ``values`` (a tensor or a list of numbers), float64 on the
    CPU (the input itself with one process)."""
    t = torch.as_tensor(values, dtype=torch.float64)
    if not active():
        return t
    d = t.to(collective_device())
    dist.all_reduce(d, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return d.cpu()


def all_gather_object(obj) -> list:
    """``obj`` of every rank, in rank order (``[obj]`` with one process)."""
    if not active():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` on every rank."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Concatenate along dim 0 the same-shaped tensor of every rank (rank order)."""
    if not active():
        return t
    d = t.contiguous().to(collective_device())
    out = torch.empty((dist.get_world_size() * d.shape[0], *d.shape[1:]), dtype=d.dtype, device=d.device)
    gather_into(out, d)
    return out.to(t.device)


def gather_into(out: torch.Tensor, t: torch.Tensor) -> None:
    """``out`` = every rank's ``t`` concatenated along dim 0 (one all-gather)."""
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor deprecated); same semantics
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, t)


def row_share(n: int, what: str = "rows") -> slice:
    """This rank's contiguous share of ``n`` rows (a batch is split evenly: every rank runs as many
    micro-batches, as FSDP's collectives need)."""
    w, r = world_size(), rank()
    if n % w:
        raise ValueError(f"{n} {what} do not split evenly over {w} ranks; make it a multiple of {w}")
    k = n // w
    return slice(r * k, (r + 1) * k)
