"""The trainer sharded over ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``), as torchtitan does it.

Where sharding is applied: on the unchanged upstream ``Qwen3MoeForCausalLM`` after the trainer swapped in its
NVFP4 modules — one ``fully_shard`` per decoder layer, then one on the root (embeddings, final norm,
lm_head). Each rank holds 1/N of every parameter along dim 0 (the experts' 3D tensors: whole experts).

Precision (``MixedPrecisionPolicy``): the sharded parameters ARE the fp32 masters (the optimizer steps them
in place); FSDP all-gathers them cast to the compute dtype (BF16), which is exactly the single-process
trainer's BF16 model (round-to-nearest of the master); gradients are reduce-scattered in fp32 as SUMS
(division off, as torchtitan does for a loss normalised by a global token count) and accumulate in fp32 on
the shards across micro-batches.

Quantizers on sharded parameters: during a layer's forward and backward FSDP has it unsharded, so every
NVFP4 module sees the whole BF16 weight it computes with and quantizes it as on one GPU (the same codes —
tests/test_distributed.py checks); the per-update weight cache keeps those codes for the update's later
micro-batches. The MoE experts are 3D parameters whose gradient always covers every expert (zeros for the
unrouted ones), so no rank ever lacks a gradient and no dummy expert input is needed.

Checkpoints (``save`` / ``load``): torch.distributed.checkpoint (DCP) writes each rank's shards in parallel
into a directory, with the trainer's small state (update count, per-rank RNG) beside them; DCP reshards on
load, so any number of ranks resumes it. The single-process format (one ``torch.save`` file) loads here too,
and a single process loads a DCP directory (``Trainer.load``).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from minite import distributed as D

META = "trainer_meta.pt"          # beside the DCP shards: what is not a tensor


def shard_model(model: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype) -> None:
    """fully_shard every decoder layer, then the root; the parameters become fp32 DTensor shards (the masters).
    Layers are widened and sharded one at a time, so a rank never holds the whole model in fp32."""
    mesh = init_device_mesh(device.type, (D.world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                              reduce_dtype=torch.float32)
    layers = list(model.model.layers)
    for i, layer in enumerate(layers):
        layer.float()
        # the last layer stays gathered after forward: backward starts with it
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    for p in model.parameters():          # the root's own: embeddings, final norm, lm_head
        if not isinstance(p, DTensor):
            p.data = p.data.float()
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # gradients are SUMMED over ranks: the loss is already divided by the global loss-token count
            m.set_gradient_divide_factor(1.0)
            if hasattr(m, "set_force_sum_reduction_for_comms"):   # gloo has no pre-multiplied sum
                m.set_force_sum_reduction_for_comms(True)


def batch_layout(rows: int, loss_tokens: int, tokens: int, chunks: int) -> tuple[int, int, int, int]:
    """(loss tokens, sequences, this rank's first row, tokens) of the whole batch split over the ranks (each
    rank gives its own counts). Every rank must run as many micro-batches (each one is a round of FSDP
    collectives): a ValueError on every rank otherwise, instead of a hang."""
    per_rank = D.all_gather_object((rows, loss_tokens, tokens, chunks))
    if len({c for *_, c in per_rank}) != 1:
        raise ValueError(f"ranks would run different numbers of micro-batches {[c for *_, c in per_rank]}: "
                         "give every rank as many sequences")
    offset = sum(r[0] for r in per_rank[:D.rank()])
    return (sum(r[1] for r in per_rank), sum(r[0] for r in per_rank), offset, sum(r[2] for r in per_rank))


def check_chunks(chunks: int) -> None:
    """Forward-only passes (log-probs) also need the same number of micro-batches on every rank."""
    batch_layout(0, 0, 0, chunks)


def full_value(x) -> torch.Tensor:
    """A DTensor's whole value (a collective); anything else as it is."""
    return x.full_tensor() if isinstance(x, DTensor) else x


# ------------------------------------------------------------------------------------------ checkpoints
def save(trainer, path: str | Path) -> None:
    """DCP checkpoint of the sharded trainer into directory ``path`` (every rank writes its shards)."""
    path = Path(path)
    state = {"model": get_model_state_dict(trainer.model),
             "optim": get_optimizer_state_dict(trainer.model, trainer.optimizer)}
    dcp.save(state, checkpoint_id=str(path))
    rngs = D.all_gather_object(trainer.rng_state())
    if D.is_main():
        torch.save({**trainer.identity(), "update_count": trainer.update_count,
                    "quant_version": trainer.qstate.version,
                    "rounding_seed": trainer.rounding_seed, "world_size": D.world_size(), "rng": rngs},
                   path / META)
    D.barrier()


def is_sharded_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / META).is_file()


def load(trainer, path: str | Path) -> dict:
    """Load a checkpoint into the sharded trainer: a DCP directory (any world size) or a single-process file.
    Returns the checkpoint's trainer state (identity, update count, RNG of this rank when it has one)."""
    path = Path(path)
    model, optim = trainer.model, trainer.optimizer
    if is_sharded_checkpoint(path):
        meta = torch.load(path / META, map_location="cpu", weights_only=True)
        trainer.check_identity(meta, path)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optim, state["optim"])
        rng = meta["rng"][D.rank()] if meta["world_size"] == D.world_size() else None
        return {**meta, "rng": rng}
    single = torch.load(path, map_location="cpu", weights_only=True)
    trainer.check_identity(single, path)
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, single["master"], options=full)
    set_optimizer_state_dict(model, optim, optimizer_by_name(single["optimizer"], trainer.names), options=full)
    return {**single, "rng": single["rng"] if D.world_size() == 1 else None}


def load_into_single(path: str | Path, names: list[str]) -> dict:
    """A DCP directory as the single-process checkpoint dict (``Trainer.save``'s format), for a trainer in one
    process (an evaluation after a run on several GPUs)."""
    path = Path(path)
    meta = torch.load(path / META, map_location="cpu", weights_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp) / "full.pt")
        full = torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=True)
    rng = meta["rng"][0]
    return {**meta, "master": full["model"], "optimizer": optimizer_by_index(full["optim"], names), "rng": rng}


def optimizer_by_name(osd: dict, names: list[str]) -> dict:
    """torch.optim's state dict (parameters by index) -> the parameter-name form of DCP's state_dict API."""
    return {"state": {names[i]: s for i, s in osd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]}


def optimizer_by_index(osd: dict, names: list[str]) -> dict:
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: s for n, s in osd["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]}


def full_model_state(model: torch.nn.Module, dtype: torch.dtype) -> dict:
    """The whole model's weights in ``dtype`` on rank 0's CPU (other ranks: {}), for save_pretrained."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.to(dtype) for k, v in sd.items()}
