"""The sampling engine: an independent, vLLM-like implementation of Qwen3-MoE (not the HF model).

What it shares with vLLM's structure: fused QKV and fused gate/up weights, a preallocated KV cache
[layers, B, kv_heads, max_seq, head_dim], one batched prefill of the prompts then one token per sequence per
decode step, experts as grouped GEMMs over rows sorted by expert, temperature / top-p sampling. Its numerics
follow ``arm.sampler`` (GEMM path, attention, non-GEMM ops: see ``sampler_ops``, high-precision modules).

Log-probs: ``generate`` returns, for every sampled token, its log-prob under the model's distribution at
temperature 1.0 with no top-p truncation (vLLM's default "raw" log-probs) — the quantity RL frameworks
compare with the trainer's teacher-forced log-probs. Temperature / top-p only change which token is drawn.

One forward (``_forward``) serves prefill and decode: T new tokens per sequence at positions start_b ..
start_b + T - 1 are written into the cache and attend to cache keys 0 .. their own position. ``score``
replays given tokens through the decode path (prefill the prompt, then one token per step), exactly as
``generate`` computed them; ``score(..., path="prefill")`` does one full-sequence forward instead (the
trainer's shape), which with invariant attention + kernel GEMM + "hf" ops gives the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minite.engines import sampler_ops as ops
from minite.engines.arms import Arm
from minite.engines.attention import invariant_attention
from minite.engines.sampler_weights import build_sampler_weights
from minite.tokenizer import EOS, PAD, CharTokenizer


@dataclass
class GenerationOutput:
    tokens: torch.Tensor          # [B, W] long: prompt, then response, PAD after the stop token
    prompt_lens: torch.Tensor     # [B] long
    response_mask: torch.Tensor   # [B, W] long: 1 on generated tokens (stop token included)
    logprobs: torch.Tensor        # [B, W] fp32: sampler log-prob of each generated token, 0 elsewhere
    texts: list[str] | None = None


def hf_config_of(model_cfg):
    """A transformers Qwen3MoeConfig from a model dict (configs/models) or an existing config object."""
    if hasattr(model_cfg, "to_dict"):
        return model_cfg
    from minite.engines.models import build_hf_config, load_model_config

    return build_hf_config(load_model_config(model_cfg))


class Sampler:
    def __init__(self, arm: Arm, model_cfg, device="cpu", max_batch: int = 64, max_seq_len: int | None = None):
        self.arm, self.recipe = arm, arm.sampler
        if self.recipe.non_gemm not in ops.NON_GEMM:
            raise ValueError(f"sampler non_gemm {self.recipe.non_gemm!r}: expected one of {ops.NON_GEMM}")
        if isinstance(model_cfg, str):
            from minite.engines.models import load_model_config

            model_cfg = load_model_config(model_cfg)
        self.model_cfg = model_cfg
        self.config = hf_config_of(model_cfg)
        c = self.config
        self.device = torch.device(device)
        self.num_layers, self.hidden = c.num_hidden_layers, c.hidden_size
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.n_q, self.n_kv = c.num_attention_heads, c.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.eps = c.rms_norm_eps
        self.max_batch = int(max_batch)
        self.max_seq_len = int(max_seq_len or c.max_position_embeddings)
        self.rotary = ops.Rotary(c, self.recipe.non_gemm, self.max_seq_len, self.device)
        self.weights = None            # sampler_weights.SamplerWeights, set by load_weights (only through sync)
        self._cache = None             # (k, v) [L, B, kv_heads, max_seq, head_dim], allocated on first use
        tok = model_cfg.get("tokenizer") if isinstance(model_cfg, dict) else None
        self.tokenizer = CharTokenizer() if tok == "char" else None

    # ------------------------------------------------------------------------------------------ weights
    def load_weights(self, payload: dict) -> None:
        """Install weights from a sync payload (``trainer.export_weights()`` format, docs/ENGINES.md). Static
        activation scales from an earlier ``calibrate`` are kept (vLLM calibrates once, at start)."""
        old = self.weights
        self.weights = build_sampler_weights(payload, self.recipe, self.config, self.device)
        if old is not None:
            self.weights.copy_amax_from(old)

    def _need_weights(self):
        if self.weights is None:
            raise RuntimeError("sampler has no weights: call sync_weights(trainer, sampler) / load_weights first")
        return self.weights

    def input_amax(self) -> dict[str, torch.Tensor]:
        """Calibrated activation amax per quantized linear (names as in ``SamplerWeights.linears``)."""
        return self._need_weights().amax_dict()

    @torch.no_grad()
    def calibrate(self, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
        """Run the prompts once (prefill, activations unquantized) and record each quantized linear's input
        amax over real tokens: the static scales of arms with ``activations.scaling: static`` (vLLM stores
        G = 1 / input_scale, input_scale = amax / 2688). Fused q/k/v and gate/up share one input, hence one
        amax; experts share one amax per layer and projection (vLLM takes the max over experts)."""
        w = self._need_weights()
        self._check_prompts(prompts)
        calib = ops.Calibrator()
        for i in range(0, len(prompts), self.max_batch):
            chunk = prompts[i:i + self.max_batch]
            ids, lens = self._pad(chunk)
            valid = (torch.arange(ids.shape[1], device=self.device)[None, :] < lens[:, None]).reshape(-1)
            h, pend, _ = self._forward(ids, torch.zeros_like(lens), calib=calib, valid=valid)
            self._logits(h, pend, rows=valid.nonzero().squeeze(-1), calib=calib)  # lm_head, if quantized
        w.set_amax(calib.amax)
        return dict(calib.amax)

    # ------------------------------------------------------------------------------------------ forward
    def _kv(self, batch: int):
        if batch > self.max_batch:
            raise ValueError(f"batch of {batch} sequences exceeds the sampler's max_batch={self.max_batch}")
        if self._cache is None or self._cache[0].shape[1] < batch:  # grows to the largest batch seen
            shape = (self.num_layers, batch, self.n_kv, self.max_seq_len, self.head_dim)
            self._cache = (torch.zeros(shape, dtype=torch.bfloat16, device=self.device),
                           torch.zeros(shape, dtype=torch.bfloat16, device=self.device))
        return self._cache

    def _attention(self, li, lw, x, pos, calib, valid):
        b, t, _ = x.shape
        qkv = ops.linear(x, lw.qkv, self.recipe, calib, valid)
        nq, nkv = self.n_q * self.head_dim, self.n_kv * self.head_dim
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        mode = self.recipe.non_gemm
        q = ops.rms_norm(q.reshape(b, t, self.n_q, self.head_dim), lw.q_norm, self.eps, mode).transpose(1, 2)
        k = ops.rms_norm(k.reshape(b, t, self.n_kv, self.head_dim), lw.k_norm, self.eps, mode).transpose(1, 2)
        v = v.reshape(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q, k, pos)
        kc, vc = self._kv(b)
        bi = torch.arange(b, device=self.device)[:, None].expand(b, t)
        kc[li, :b][bi, :, pos] = k.transpose(1, 2).to(kc.dtype)   # [B, T, kv, D] into [B, kv, S, D]
        vc[li, :b][bi, :, pos] = v.transpose(1, 2).to(vc.dtype)
        s = int(pos.max()) + 1                                     # the valid cache prefix
        keys, vals = kc[li, :b, :, :s], vc[li, :b, :, :s]
        keep = torch.arange(s, device=self.device)[None, None, None, :] <= pos[:, None, :, None]
        if self.recipe.attention == "invariant":
            o = invariant_attention(q, keys, vals, self.scaling, keep=keep)
        else:
            rep = self.n_q // self.n_kv
            o = F.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1),
                                               attn_mask=keep, scale=self.scaling).transpose(1, 2)
        return ops.linear(o.reshape(b, t, nq), lw.o, self.recipe, calib, valid)

    def _mlp(self, lw, x, calib, valid, cap):
        b, t, h = x.shape
        x2 = x.reshape(-1, h)
        if lw.experts is None:  # a dense layer (mlp_only_layers / decoder_sparse_step)
            gate, up = ops.linear(x2, lw.gate_up, self.recipe, calib, valid).chunk(2, dim=-1)
            return ops.linear(ops.silu_mul(gate, up, self.recipe.non_gemm), lw.down, self.recipe, calib,
                              valid).reshape(b, t, h)
        logits = ops.linear(x2, lw.router, self.recipe, calib, valid)
        weights, idx = ops.route(logits, self.config.num_experts_per_tok, self.config.norm_topk_prob,
                                 self.recipe.non_gemm)
        cap("router_logits", logits.reshape(b, t, -1))
        cap("topk", idx.reshape(b, t, -1))
        return ops.moe(x2, lw.experts, weights, idx, self.recipe, calib, valid).reshape(b, t, h)

    def _forward(self, ids, start, capture=None, calib=None, valid=None):
        """ids [B, T] at positions start[b] + t -> final hidden states [B, T, H] (before the final norm)."""
        w = self.weights
        b, t = ids.shape
        pos = start[:, None] + torch.arange(t, device=self.device)[None, :]
        if int(pos.max()) >= self.max_seq_len:
            raise ValueError(f"position {int(pos.max())} beyond the sampler's max_seq_len={self.max_seq_len}")
        mode = self.recipe.non_gemm
        h = F.embedding(ids, w.embed)
        pending = None  # the last block's output, added into the next norm (fused add + norm)
        for li, lw in enumerate(w.layers):
            def cap(op, tensor, _li=li):
                if capture is not None:
                    capture(_li, op, pos, tensor)
            if pending is None:
                x = ops.rms_norm(h, lw.input_norm, self.eps, mode)
            else:
                x, h = ops.add_rms_norm(pending, h, lw.input_norm, self.eps, mode)
            a = self._attention(li, lw, x, pos, calib, valid)
            cap("attn_out", a)
            x, h = ops.add_rms_norm(a, h, lw.post_norm, self.eps, mode)
            pending = self._mlp(lw, x, calib, valid, cap)
            cap("moe_out", pending)
            if capture is not None:  # the layer's output residual stream, as the next fused op will store it
                cap("residual", h + pending if mode == "hf" else (h.float() + pending.float()).to(h.dtype))
        return h, pending, pos

    def _logits(self, h, pending, rows=None, calib=None, valid=None):
        """Final (fused add +) norm and lm_head on the selected rows [M] of the flattened [B*T] hidden."""
        hs, ps = h.reshape(-1, self.hidden), pending.reshape(-1, self.hidden)
        if rows is not None:
            hs, ps = hs[rows], ps[rows]
        x, _ = ops.add_rms_norm(ps, hs, self.weights.norm, self.eps, self.recipe.non_gemm)
        return ops.linear(x, self.weights.lm_head, self.recipe, calib, valid)

    # ------------------------------------------------------------------------------------------ inputs
    def _check_prompts(self, prompts):
        if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
            raise ValueError("prompts: expected a non-empty list of token-id lists")
        v = self.config.vocab_size
        for i, p in enumerate(prompts):
            p = p.tolist() if isinstance(p, torch.Tensor) else list(p)
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty (every sequence needs at least one token, e.g. BOS)")
            if len(p) > self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens, longer than max_seq_len={self.max_seq_len}")
            if min(p) < 0 or max(p) >= v:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {v})")

    def _pad(self, prompts):
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device)
        ids = torch.full((len(prompts), int(lens.max())), PAD, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.as_tensor(list(p), dtype=torch.long, device=self.device)
        return ids, lens

    # ------------------------------------------------------------------------------------------ public
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, generator: torch.Generator | None = None, stop_token: int | None = EOS,
                 ) -> GenerationOutput:
        self._need_weights()
        self._check_prompts(prompts)
        if int(max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1]; got {temperature}, {top_p}")
        prompts = [p.tolist() if isinstance(p, torch.Tensor) else list(p) for p in prompts]
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_seq_len={self.max_seq_len}")
        ids, lens = self._pad(prompts)
        b = ids.shape[0]
        h, pend, _ = self._forward(ids, torch.zeros_like(lens))
        rows = torch.arange(b, device=self.device) * ids.shape[1] + lens - 1  # each prompt's last token
        logits = self._logits(h, pend, rows)
        new = torch.full((b, max_new_tokens), PAD, dtype=torch.long, device=self.device)
        new_lp = torch.zeros((b, max_new_tokens), dtype=torch.float32, device=self.device)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        n_gen = torch.zeros(b, dtype=torch.long, device=self.device)
        for step in range(max_new_tokens):
            lf = logits.float()
            tok = ops.sample_tokens(lf, temperature, top_p, generator)
            lp = torch.log_softmax(lf, dim=-1).gather(-1, tok[:, None]).squeeze(-1)
            live = ~done
            new[:, step] = torch.where(live, tok, torch.full_like(tok, PAD))
            new_lp[:, step] = torch.where(live, lp, torch.zeros_like(lp))
            n_gen += live.long()
            if stop_token is not None:
                done |= live & (tok == stop_token)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            h, pend, _ = self._forward(new[:, step:step + 1], lens + step)
            logits = self._logits(h, pend)
        return self._assemble(prompts, lens, new, new_lp, n_gen)

    def _assemble(self, prompts, lens, new, new_lp, n_gen):
        b = len(prompts)
        width = int((lens + n_gen).max())
        tokens = torch.full((b, width), PAD, dtype=torch.long, device=self.device)
        mask = torch.zeros((b, width), dtype=torch.long, device=self.device)
        lps = torch.zeros((b, width), dtype=torch.float32, device=self.device)
        texts = [] if self.tokenizer is not None else None
        for i, p in enumerate(prompts):
            n, pl = int(n_gen[i]), len(p)
            tokens[i, :pl] = torch.as_tensor(p, device=self.device)
            tokens[i, pl:pl + n] = new[i, :n]
            mask[i, pl:pl + n] = 1
            lps[i, pl:pl + n] = new_lp[i, :n]
            if texts is not None:
                texts.append(self.tokenizer.decode(new[i, :n]))
        return GenerationOutput(tokens, lens.clone(), mask, lps, texts)

    @torch.no_grad()
    def score(self, tokens: torch.Tensor, prompt_lens, capture=None, path: str = "decode") -> torch.Tensor:
        """Log-probs [B, W] fp32 of tokens[b, t] for t >= prompt_lens[b] (0 on prompt positions), recomputed
        by teacher forcing through the decode path (``path="decode"``: prefill the prompt, then one token per
        step, as ``generate`` does) or one full-sequence forward (``path="prefill"``). ``capture(layer, op,
        positions [B, T], tensor [B, T, ...])`` sees op in {"attn_out", "router_logits", "topk", "moe_out",
        "residual"} per layer and ("logits", layer -1) with the [B, 1, V] logits each step."""
        self._need_weights()
        tokens = torch.as_tensor(tokens, device=self.device).long()
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected [B, W], got shape {tuple(tokens.shape)}")
        b, width = tokens.shape
        lens = torch.as_tensor(prompt_lens, device=self.device).long().reshape(-1)
        if lens.numel() != b or int(lens.min()) < 1 or int(lens.max()) > width:
            raise ValueError("prompt_lens: one length per row, each in [1, W]")
        if width > self.max_seq_len:
            raise ValueError(f"sequence width {width} exceeds max_seq_len={self.max_seq_len}")
        out = torch.zeros((b, width), dtype=torch.float32, device=self.device)
        if path == "prefill":
            h, pend, pos = self._forward(tokens, torch.zeros_like(lens), capture)
            logits = self._logits(h, pend).reshape(b, width, -1)
            if capture is not None:
                capture(-1, "logits", pos, logits)
            lp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
            keep = torch.arange(1, width, device=self.device)[None, :] >= lens[:, None]
            out[:, 1:] = torch.where(keep, lp, torch.zeros_like(lp))
            return out
        if path != "decode":
            raise ValueError(f"path must be 'decode' or 'prefill', not {path!r}")
        prompts = [tokens[i, :int(lens[i])].tolist() for i in range(b)]
        ids, _ = self._pad(prompts)
        h, pend, _ = self._forward(ids, torch.zeros_like(lens), capture)
        rows = torch.arange(b, device=self.device) * ids.shape[1] + lens - 1
        logits = self._logits(h, pend, rows)
        ar = torch.arange(b, device=self.device)
        for step in range(width - int(lens.min())):
            t = lens + step                                   # position whose token these logits predict
            if capture is not None:
                capture(-1, "logits", (t - 1)[:, None], logits[:, None])
            tgt = tokens[ar, t.clamp(max=width - 1)]
            lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tgt[:, None]).squeeze(-1)
            inside = t < width
            out[ar[inside], t[inside]] = lp[inside]
            if step == width - int(lens.min()) - 1:
                break
            feed = torch.where(inside, tgt, torch.full_like(tgt, PAD))
            h, pend, _ = self._forward(feed[:, None], t.clamp(max=self.max_seq_len - 1), capture)
            logits = self._logits(h, pend)
        return out
