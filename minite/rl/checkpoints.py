"""A stability run's directory on disk: one writer, complete checkpoints, the step log cut back on resume.

    <out>/.lock                  the pid of the one process writing the run (``single_writer``)
    <out>/run.json               the run's identity (``run_id``: arm, model, config, task, seed, warm start)
    <out>/stability.jsonl        one line per step; on resume the lines after the checkpoint are dropped
    <out>/ckpt/step_XXXXXX/      trainer state (``trainer``: masters, optimizer, RNG) + ``loop_state.json``

A checkpoint is written into a temporary directory and renamed into place, so a kill never leaves half of
one; ``checkpoints`` lists only complete ones (their ``loop_state.json`` exists). Under torchrun every rank
writes its trainer shards into ``trainer/`` (a DCP directory); rank 0 does everything else, after the others.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
from pathlib import Path

import torch

from minite import distributed as D
from minite.provenance import read_json, write_json, write_text

CKPT_PREFIX = "step_"


class RunDirectoryError(RuntimeError):
    """The run directory is busy (another writer) or holds another run's checkpoints."""


@contextlib.contextmanager
def single_writer(out: Path):
    """One process per run directory (stability.jsonl has one writer): an O_EXCL lock file holding the pid;
    a lock left by a dead process (a kill) is taken over."""
    lock = Path(out) / ".lock"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            try:
                pid = int(lock.read_text().strip() or 0)
                os.kill(pid, 0)
            except (ValueError, ProcessLookupError, FileNotFoundError):
                lock.unlink(missing_ok=True)      # stale: its process is gone
                continue
            except PermissionError:
                pass
            raise RunDirectoryError(f"{out} is being written by another process (pid {pid}); "
                                    "one writer per run") from None
    else:
        raise RunDirectoryError(f"could not take the lock {lock}")
    try:
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        yield
    finally:
        lock.unlink(missing_ok=True)


def check_run_id(out: Path, run_id: str) -> None:
    """Refuse to resume checkpoints that belong to a different run."""
    meta = Path(out) / "run.json"
    if meta.is_file() and latest_checkpoint(out) is not None:
        old = read_json(meta, "it names the run its checkpoints belong to: restore it, or use a new --out"
                        ).get("run_id")
        if old != run_id:
            raise RunDirectoryError(f"{out} holds checkpoints of a different run (run_id {old} != {run_id}: arm, "
                                    f"model, config, seed or init changed); use a new --out or delete it")


def checkpoints(out) -> list[tuple[int, Path]]:
    """Complete checkpoints (their loop_state.json exists), oldest first."""
    d = Path(out) / "ckpt"
    found = []
    for p in d.glob(f"{CKPT_PREFIX}*") if d.is_dir() else []:
        suffix = p.name[len(CKPT_PREFIX):]
        if suffix.isdigit() and (p / "loop_state.json").is_file():
            found.append((int(suffix), p))
    return sorted(found)


def latest_checkpoint(out) -> Path | None:
    ck = checkpoints(out)
    return ck[-1][1] if ck else None


def save_checkpoint(out, step: int, trainer, loop_state: dict, keep: int | None = None) -> Path:
    """``ckpt/step_XXXXXX``: the trainer's state and ``loop_state`` (JSON), atomically; then only the newest
    ``keep`` checkpoints are kept (all when None). Every rank calls it (the trainer's save is collective)."""
    d = Path(out) / "ckpt"
    final = d / f"{CKPT_PREFIX}{step:06d}"
    tmp = d / f".tmp_{CKPT_PREFIX}{step:06d}"
    main = D.is_main()
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    D.barrier()
    trainer.save(str(tmp / "trainer"))
    if main:
        write_json(tmp / "loop_state.json", loop_state)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        if keep:
            for _, old in checkpoints(out)[:-int(keep)]:
                shutil.rmtree(old, ignore_errors=True)
    D.barrier()
    return final


def load_checkpoint(path: Path, trainer) -> dict:
    """Load the trainer state of checkpoint ``path``; returns its loop state. A damaged checkpoint (a disk that
    filled up, a copy cut short) is a one-line error saying which step the run would resume from without it."""
    path = Path(path)
    earlier = [s for s, p in checkpoints(path.parent.parent) if p != path]
    fix = f"delete {path} to resume from {f'step {earlier[-1]}' if earlier else 'the start'}"
    state = read_json(path / "loop_state.json", fix)
    load_trainer(trainer, path / "trainer", fix)
    return state


def load_trainer(trainer, path: Path, fix: str) -> None:
    """``trainer.load(path)``, its unreadable-file errors (torch's name no file) as one line naming ``path``.
    A ValueError (a checkpoint of another arm or model) already names it and passes through."""
    try:
        trainer.load(str(path))
    except ValueError:
        raise
    except Exception as e:          # torch.load / DCP: RuntimeError, EOFError, UnpicklingError, KeyError ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"checkpoint {path} is unreadable ({first}); {fix}") from e


def generator_state(gen: torch.Generator) -> str:
    """A torch.Generator's state as text (for loop_state.json)."""
    return base64.b64encode(gen.get_state().numpy().tobytes()).decode()


def generator_states(gen: torch.Generator) -> dict:
    """The sampling generator's state for loop_state.json: ``generator`` (rank 0's, the one stream of a
    single process) and, under torchrun, ``generators`` (every rank's, in rank order; a collective)."""
    states = D.all_gather_object(generator_state(gen))
    return {"generator": states[0], **({"generators": states} if len(states) > 1 else {})}


def rank_generator_state(loop_state: dict) -> str:
    """This rank's sampling generator state in a checkpoint's loop state."""
    states = loop_state.get("generators", [loop_state["generator"]])
    if len(states) != D.world_size():
        raise RunDirectoryError(f"the checkpoint holds {len(states)} sampling streams, this run has "
                                f"{D.world_size()} processes: resume with the same number")
    return states[D.rank()]


def restore_generator(gen: torch.Generator, state: str) -> None:
    gen.set_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8))


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only the lines of steps <= last_step (those after the checkpoint are recomputed)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError):
            break                       # a torn last line from a kill: drop it and everything after
    write_text(path, "".join(line + "\n" for line in keep))
