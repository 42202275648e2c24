"""Localisation: where, layer by layer and op by op, do the trainer and the sampler part ways?

Both engines run the *same* tokens. The trainer does one teacher-forced forward (``trainer.logprobs``) with
forward hooks on the upstream HF modules:

    model.model.layers[i].self_attn   -> attn_out       (o_proj output, [B, T, H])
    model.model.layers[i].mlp.gate    -> router_logits  ([B*T, E]) and topk (the chosen expert ids [B*T, k])
    model.model.layers[i].mlp         -> moe_out        (MoE block output, [B, T, H])
    model.model.layers[i]             -> residual       (decoder layer output: the residual stream)
    model.lm_head                     -> logits         ([B, T, V])

The sampler replays the tokens through its *decode path* (``sampler.score(tokens, prompt_lens, capture=)``),
calling ``capture(layer, op, position, tensor)`` with the value it computed at that decode step, so each
position is compared with what generation actually computed.

Compared positions: q such that token q + 1 is a response token (``response_mask[b, q+1] == 1``): the
states that produce the response tokens' log-probs. Per (layer, op), in float64 over those positions:

    rel_err        ||a_s - a_t||_F / ||a_t||_F (trainer as reference; 0 when both are exactly equal)
    max_abs_err    max |a_s - a_t|
    topk_disagree  (op topk) mean over tokens of |experts_t \\ experts_s| / k (set difference: order-free)
    n_positions    how many (sequence, position) pairs entered the comparison

First divergence: walking ops in execution order (layer 0 attn_out, router_logits, moe_out, residual, layer 1,
..., logits), the first whose rel_err exceeds ``ROUNDING_THRESHOLD`` = 2**-7. Why that value: BF16 keeps 8
significant bits (unit roundoff u = 2**-8), so two engines that round the same real value differently, or sum
in another order, differ by about u relative per element, and a Frobenius relative error of independent
roundings stays below ~u; 2**-7 = 2u leaves room for a few such roundings while NVFP4 quantization (a 4-bit
mantissa: errors of order 2**-3..2**-4) or a wrong weight shows up far above it. topk is reported, not used
for the first divergence (a flip at a near-tie is a symptom: its effect shows up in moe_out).
"""
from __future__ import annotations

from collections import defaultdict

import pandas as pd
import torch

OPS = ("attn_out", "router_logits", "topk", "moe_out", "residual", "logits")
LAYER_OPS = ("attn_out", "router_logits", "topk", "moe_out", "residual")
ROUNDING_THRESHOLD = 2.0 ** -7


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def compare_positions(response_mask: torch.Tensor) -> torch.Tensor:
    """Bool [B, T]: positions whose state predicts a response token (q with response_mask[b, q+1] == 1)."""
    rm = torch.as_tensor(response_mask).bool()
    sel = torch.zeros_like(rm)
    sel[:, :-1] = rm[:, 1:]
    return sel


def attention_mask_for(tokens: torch.Tensor, prompt_lens, response_mask: torch.Tensor) -> torch.Tensor:
    """1 on prompt and response tokens, 0 on the padding after a stop (the trainer's attention mask)."""
    plens = torch.as_tensor(prompt_lens).view(-1, 1)
    pos = torch.arange(tokens.shape[1]).view(1, -1)
    return ((pos < plens) | torch.as_tensor(response_mask).bool()).long()


def capture_trainer(trainer, tokens: torch.Tensor, attention_mask: torch.Tensor, ops=OPS):
    """Run ``trainer.logprobs`` once with hooks; returns ({(layer, op): tensor [B, T, ...]}, logprobs). ``ops``
    limits the capture (e.g. ``("topk",)``: only the routers are hooked)."""
    model = trainer.model
    layers = model.model.layers
    B, T = tokens.shape
    store: dict[tuple[int, str], torch.Tensor] = {}
    handles = []

    def keep(key, fn=lambda o: _first(o)):
        def hook(_mod, _inp, out):
            store[key] = fn(out).detach().float().cpu()
        return hook

    def gate_hook(i, k):
        def hook(_mod, _inp, out):
            if isinstance(out, (tuple, list)):       # HF Qwen3MoeTopKRouter: (logits, scores, indices)
                logits, idx = out[0], out[-1]
            else:                                     # a router returning logits only
                logits, idx = out, out.topk(k, dim=-1).indices
            store[(i, "router_logits")] = logits.detach().float().cpu().reshape(B, T, -1)
            store[(i, "topk")] = idx.detach().cpu().reshape(B, T, -1)
        return hook

    k = int(model.config.num_experts_per_tok)
    for i, layer in enumerate(layers):
        for op, module, hook in (("attn_out", layer.self_attn, keep((i, "attn_out"))),
                                 ("topk", layer.mlp.gate, gate_hook(i, k)),
                                 ("moe_out", layer.mlp, keep((i, "moe_out"))),
                                 ("residual", layer, keep((i, "residual")))):
            if op in ops or (op == "topk" and "router_logits" in ops):
                handles.append(module.register_forward_hook(hook))
    if "logits" in ops:
        handles.append(model.lm_head.register_forward_hook(keep((len(layers), "logits"))))
    try:
        lp = trainer.logprobs(tokens, attention_mask)
    finally:
        for h in handles:
            h.remove()
    for key, t in store.items():  # [B*T, ...] flattened by some modules -> [B, T, ...]
        if t.shape[0] != B:
            store[key] = t.reshape(B, T, *t.shape[1:]) if t.shape[0] == B * T else t
    return store, lp


class SamplerCapture:
    """Collects ``capture(layer, op, positions, tensor)`` calls into [B, T, ...] tensors (NaN / -1 where the
    sampler reported nothing). A later call for the same position overwrites an earlier one, so a decode
    step's value replaces the prefill's padding garbage at that position.

    ``positions``: [B, T] per-row positions with ``tensor`` [B, T, ...] (the sampler's form), or an int /
    a [B] tensor (one position per row, ``tensor`` [B, ...] or [B, 1, ...]), or a range of positions shared
    by all rows with ``tensor`` [B, len, ...]. ``layer`` -1 / None for op "logits" (after the last layer).
    ``ops`` limits what is kept (e.g. ``("topk",)``); calls for other ops are ignored."""

    def __init__(self, batch: int, seq_len: int, num_layers: int, ops=OPS):
        self.B, self.T, self.L = batch, seq_len, num_layers
        self.ops = frozenset(ops)
        self.data: dict[tuple[int, str], torch.Tensor] = {}
        self.calls = defaultdict(int)

    def _positions(self, position) -> torch.Tensor:
        B = self.B
        if isinstance(position, int):
            return torch.full((B, 1), position, dtype=torch.long)
        if isinstance(position, torch.Tensor):
            p = position.detach().cpu().long()
            if p.dim() == 0:
                return p.expand(B, 1).clone()
            if p.dim() == 1 and p.numel() == B:
                return p[:, None]
            if p.dim() == 2 and p.shape[0] == B:
                return p
            return p.reshape(1, -1).expand(B, -1)
        return torch.as_tensor(list(position), dtype=torch.long).reshape(1, -1).expand(B, -1)

    def __call__(self, layer, op, position, tensor):
        if op not in self.ops:
            return
        layer = self.L if op == "logits" else int(layer)
        t = tensor.detach().cpu()
        t = t.long() if op == "topk" else t.float()
        if t.shape[0] != self.B:
            raise ValueError(f"sampler capture {op} layer {layer}: leading dim {t.shape[0]} != batch {self.B}")
        pos = self._positions(position)
        if t.dim() < 2 or t.shape[1] != pos.shape[1]:
            t = t.unsqueeze(1)                      # one position per row given without a T dim
        if t.shape[1] != pos.shape[1]:
            raise ValueError(f"sampler capture {op} layer {layer}: {pos.shape[1]} positions for a tensor "
                             f"{tuple(tensor.shape)}")
        rows = torch.arange(self.B)[:, None].expand_as(pos).reshape(-1)
        cols = pos.reshape(-1)
        vals = t.reshape(rows.numel(), *t.shape[2:])
        key = (layer, op)
        if key not in self.data:
            fill = -1 if op == "topk" else float("nan")
            self.data[key] = torch.full((self.B, self.T, *vals.shape[1:]), fill, dtype=vals.dtype)
        ok = (cols >= 0) & (cols < self.T)
        self.data[key][rows[ok], cols[ok]] = vals[ok]
        self.calls[key] += 1


def _rows(layer, op, metric, value):
    return {"layer": int(layer), "op": op, "metric": metric, "value": float(value)}


def compare(trainer_store: dict, sampler_store: dict, positions: torch.Tensor) -> pd.DataFrame:
    """Tidy table (layer, op, metric, value) of the per-layer/op comparison over ``positions`` [B, T]."""
    rows = []
    keys = sorted(set(trainer_store) & set(sampler_store), key=lambda k: (k[0], OPS.index(k[1])))
    for layer, op in keys:
        a_t, a_s = trainer_store[(layer, op)], sampler_store[(layer, op)]
        if a_t.shape[:2] != a_s.shape[:2] or a_t.shape[2:] != a_s.shape[2:]:
            raise ValueError(f"layer {layer} {op}: trainer {tuple(a_t.shape)} vs sampler {tuple(a_s.shape)}")
        sel = positions.clone()
        if op == "topk":
            sel &= (a_s >= 0).all(-1)
            t, s = a_t[sel], a_s[sel]
            n = int(sel.sum())
            if n == 0:
                continue
            k = t.shape[-1]
            same = (t.unsqueeze(-1) == s.unsqueeze(-2)).any(-1).sum(-1)   # |t & s| per token
            rows.append(_rows(layer, op, "topk_disagree", float((k - same).double().mean() / k)))
            rows.append(_rows(layer, op, "n_positions", n))
            continue
        sel &= torch.isfinite(a_s.reshape(*a_s.shape[:2], -1)).all(-1)
        n = int(sel.sum())
        if n == 0:
            continue
        t, s = a_t[sel].double(), a_s[sel].double()
        diff = s - t
        ref = float(t.norm())
        err = float(diff.norm())
        rel = 0.0 if err == 0.0 else (err / ref if ref > 0 else float("inf"))
        rows.append(_rows(layer, op, "rel_err", rel))
        rows.append(_rows(layer, op, "max_abs_err", float(diff.abs().max())))
        rows.append(_rows(layer, op, "n_positions", n))
    return pd.DataFrame(rows, columns=["layer", "op", "metric", "value"])


def first_divergence(table: pd.DataFrame, threshold: float = ROUNDING_THRESHOLD) -> dict | None:
    """The first (layer, op) in execution order whose rel_err exceeds ``threshold``; None if none does."""
    d = table[table["metric"] == "rel_err"].copy()
    d["order"] = [(layer, OPS.index(op)) for layer, op in zip(d["layer"], d["op"], strict=True)]
    for _, r in d.sort_values("order").iterrows():
        if r["value"] > threshold:
            return {"layer": int(r["layer"]), "op": r["op"], "rel_err": float(r["value"]), "threshold": threshold}
    return None


def localise(trainer, sampler, tokens: torch.Tensor, prompt_lens, response_mask: torch.Tensor) -> dict:
    """Run both engines on ``tokens`` with capture; returns {"table", "first_divergence", "logp_t", "logp_s",
    "captured"} (table: tidy DataFrame; logp_*: the two engines' log-probs of the same tokens)."""
    tokens = torch.as_tensor(tokens).cpu()
    response_mask = torch.as_tensor(response_mask).cpu()
    att = attention_mask_for(tokens, prompt_lens, response_mask)
    t_store, logp_t = capture_trainer(trainer, tokens, att)
    num_layers = len(trainer.model.model.layers)
    cap = SamplerCapture(tokens.shape[0], tokens.shape[1], num_layers)
    logp_s = sampler.score(tokens, prompt_lens, capture=cap)
    table = compare(t_store, cap.data, compare_positions(response_mask))
    missing = sorted(set(t_store) - set(cap.data))
    return {"table": table, "first_divergence": first_divergence(table), "logp_t": logp_t, "logp_s": logp_s,
            "captured": {"trainer": len(t_store), "sampler": len(cap.data), "missing_in_sampler": missing}}
