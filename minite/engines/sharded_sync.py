"""Weight sync from the sharded trainer: every rank receives the whole payload, gathered layer by layer in
buckets, so each rank's sampler replica gets the weights one process would ship.

Each rank holds dim-0 shards of every parameter (``fsdp.py``; rank r has rows [r*c, (r+1)*c) with
c = ceil(N / ranks), as ``torch.chunk`` splits). Parameters are taken in the model's order and grouped by unit
(a decoder layer, or the root's embeddings / norm / lm_head); consecutive units fill a bucket up to
``BUCKET_BYTES`` of gathered payload. Per bucket, every rank packs its pieces, each padded to c rows, into one
byte buffer, and one ``all_gather_into_tensor`` gives every rank every piece; the first N rows of the
concatenated rank blocks are the whole tensor.

What travels:
    ``bf16`` sync (bf16 and naive arms): every shard in BF16, the weights the trainer computes with
    (FSDP gathers the fp32 masters rounded to BF16 the same way).
    ``nvfp4_codes`` sync (miniTE): each weight the trainer quantizes travels as the NVFP4 codes and E4M3 block
    scales of its shard (0.5625 bytes per weight instead of 2); everything else in BF16. Every rank quantizes
    its own rows with the trainer's quantizer, so the codes are the rows of the whole tensor's codes:
        experts [E, N, K]  whole experts per rank; global scales are per expert (per gate / up shard), so
                           ``quant_linear.quantize_weight`` of the local experts is exact; their decode global
                           scales travel with the codes.
        dense   [N, K]     rows split on a tile boundary; the per-tensor amax is all-reduced (max) over the
                           ranks first, and ``nvfp4.quantize`` takes it, so the block and global scales are
                           those of the whole tensor.
    A weight whose shards do not fall on tile boundaries (or whose recipe has no per-tensor amax) travels in
    BF16 and every rank quantizes the whole of it (the same codes, more bytes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from minite import distributed as D
from minite import nvfp4
from minite.engines import quant_linear as Q
from minite.engines.names import is_quantized, param_kind

BUCKET_BYTES = 512 * 2 ** 20       # gathered payload per bucket (one all-gather)


@dataclass
class _Piece:
    """One tensor gathered along dim 0: this rank's rows, the whole tensor's row count and element type."""

    local: torch.Tensor
    rows: int

    def chunk(self, world: int) -> int:
        return -(-self.rows // world)

    def row_bytes(self) -> int:
        return math.prod(self.local.shape[1:]) * self.local.element_size()


@dataclass
class _Item:
    """One payload entry: its pieces and how to assemble them once gathered."""

    name: str
    how: str                      # "bf16" | "dense" (codes) | "experts" (codes) | "quantize" (BF16, then codes)
    pieces: list[_Piece] = field(default_factory=list)
    global_scale: torch.Tensor | None = None     # dense codes: the per-tensor decode scale (same on every rank)
    shards: int = 1


def _local(p) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _tile_aligned(rows: int, tile_rows: int, world: int) -> bool:
    """Every rank holds at least one row and every shard boundary falls on a tile boundary."""
    c = -(-rows // world)
    return c % tile_rows == 0 and rows > (world - 1) * c


def _plan(trainer) -> list[list[tuple[str, str, torch.Tensor, int]]]:
    """[(name, how, local BF16 shard, rows of the whole)] per unit, in the model's parameter order."""
    arm, world = trainer.arm, D.world_size()
    n_layers = trainer.model_cfg["num_hidden_layers"]
    spec = arm.trainer.weights
    units, key = [], object()
    for name, p in trainer.model.named_parameters():
        local = _local(p).detach().to(torch.bfloat16)
        how = "bf16"
        if arm.sync == "nvfp4_codes" and is_quantized(arm.trainer, name, n_layers):
            kind, _ = param_kind(name)
            rows = p.shape[0]
            if spec.scaling != "tensor" or spec.formula not in ("te", "modelopt"):
                how = "quantize"
            elif kind == "experts":
                how = "experts" if rows > (world - 1) * (-(-rows // world)) else "quantize"
            else:
                tile_rows = Q._weight_tile(spec, rows)[0]
                how = "dense" if _tile_aligned(rows, tile_rows, world) else "quantize"
        unit = param_kind(name)[1]
        if unit != key or not units:
            units.append([])
            key = unit
        units[-1].append((name, how, local, p.shape[0]))
    return units


def _items(bucket, spec) -> list[_Item]:
    """Quantize this rank's shards where codes travel (one all-reduce of the dense weights' amaxes first)."""
    dense = [local for _, how, local, _ in bucket if how == "dense"]
    amax = D.all_reduce([float(x.float().abs().amax()) if x.numel() else 0.0 for x in dense], "max") \
        if dense else None
    items, j = [], 0
    for name, how, local, rows in bucket:
        if how == "dense":
            # the whole tensor's amax, given as static scaling takes it: the arithmetic of "tensor" scaling
            q = nvfp4.quantize(local, formula=spec.formula, tile=Q._weight_tile(spec, rows), scaling="static",
                               amax=amax[j].to(torch.float32).to(local.device), check=False)
            j += 1
            items.append(_Item(name, how, [_Piece(q.codes, rows), _Piece(q.scales, rows)], q.global_scale))
        elif how == "experts":
            shards = 2 if name.endswith(".gate_up_proj") else 1
            q = Q.quantize_weight(local, spec, shards)
            items.append(_Item(name, how, [_Piece(q.codes, rows), _Piece(q.scales, rows),
                                           _Piece(q.global_scale, rows)], shards=shards))
        else:
            items.append(_Item(name, how, [_Piece(local, rows)]))
    return items


def _gather(pieces: list[_Piece], world: int) -> tuple[list[torch.Tensor], int]:
    """Every piece whole on every rank (one all-gather), and the bytes gathered."""
    blocks = []
    for pc in pieces:
        c, rb = pc.chunk(world), pc.row_bytes()
        flat = pc.local.contiguous().view(pc.local.shape[0], -1).view(torch.uint8)
        blocks.append(torch.nn.functional.pad(flat, (0, 0, 0, c - flat.shape[0])).reshape(-1)
                      if flat.shape[0] < c else flat.reshape(-1))
    send = torch.cat(blocks)
    dev = D.collective_device()
    recv = torch.empty(world * send.numel(), dtype=torch.uint8, device=dev)
    D.gather_into(recv, send.to(dev))
    recv = recv.view(world, -1).to(pieces[0].local.device)
    out, off = [], 0
    for pc in pieces:
        c, rb = pc.chunk(world), pc.row_bytes()
        rows = recv[:, off:off + c * rb].reshape(world * c, rb)[:pc.rows]
        out.append(rows.contiguous().view(pc.local.dtype).view(pc.rows, *pc.local.shape[1:]))
        off += c * rb
    return out, recv.numel()


def export_sharded(trainer, bucket_bytes: int = BUCKET_BYTES) -> tuple[dict, dict]:
    """The sync payload (docs/ENGINES.md, Sync) of a sharded trainer, whole on every rank, and a summary:
    buckets, bytes all-gathered (per rank received, padding included)."""
    arm, world = trainer.arm, D.world_size()
    spec = arm.trainer.weights
    units = _plan(trainer)
    buckets, size = [], bucket_bytes
    for unit in units:
        est = sum(local.numel() * (2 if how in ("bf16", "quantize") else 0.6) * world
                  for _, how, local, _ in unit)
        if size + est > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].extend(unit)
        size += est
    tensors, gathered = {}, 0
    with torch.no_grad():
        for bucket in buckets:
            items = _items(bucket, spec)
            whole, n = _gather([pc for it in items for pc in it.pieces], world)
            gathered += n
            k = 0
            for it in items:
                parts = whole[k:k + len(it.pieces)]
                k += len(it.pieces)
                if it.how == "dense":
                    tensors[it.name] = nvfp4.NVFP4Tensor(parts[0], parts[1], it.global_scale)
                elif it.how == "experts":
                    tensors[it.name] = Q.QWeight(*parts, dq=None).tensors()
                elif it.how == "quantize":
                    kind, _ = param_kind(it.name)
                    if kind == "experts":
                        shards = 2 if it.name.endswith(".gate_up_proj") else 1
                        tensors[it.name] = Q.quantize_weight(parts[0], spec, shards).tensors()
                    else:
                        tensors[it.name] = Q.quantize_weight(parts[0], spec).tensor()
                else:
                    tensors[it.name] = parts[0]
    form = "nvfp4_codes" if arm.sync == "nvfp4_codes" else "bf16"
    return {"form": form, "tensors": tensors}, {"buckets": len(buckets), "gathered_bytes": gathered}
