"""The sampling engine: an independent, vLLM-like implementation of Qwen3-MoE (not the HF model).

What it shares with vLLM's structure: fused QKV and fused gate/up weights, a preallocated KV cache
[layers, slots, kv_heads, max_seq, head_dim] with one slot per sequence (and one dummy slot for padding
rows), one batched prefill of the prompts then one token per sequence per decode step, experts as grouped
GEMMs over rows sorted by expert, temperature / top-p sampling. Its numerics follow ``arm.sampler`` (GEMM
path, attention, non-GEMM ops: see ``sampler_ops``, high-precision modules).

The decode step has static shapes and reads nothing back to the host: token ids, positions and cache slots
are device buffers of a captured batch size, KV is written in place at (slot, position), attention runs over
the slot-indexed cache (``sampler_ops.decode_attention``), experts through one grouped GEMM per projection,
and the token is drawn on the device. ``decode_graphs`` captures it in a CUDA graph per batch size and drops
finished sequences from the running batch; on CPU or with ``cuda_graphs=False`` the same step runs eagerly.

Log-probs: ``generate`` returns, for every sampled token, its log-prob under the model's distribution at
temperature 1.0 with no top-p truncation (vLLM's default "raw" log-probs) — the quantity RL frameworks
compare with the trainer's teacher-forced log-probs. Temperature / top-p only change which token is drawn.
Randomness: one uniform draw per (sequence, position), taken from the caller's generator before the first
step, picks the token by inverse CDF; so the same generator state gives the same tokens, eager or graphed,
whichever rows share a step.

``score`` replays given tokens through the same decode step (prefill the prompt, then one token per step);
``score(..., path="prefill")`` does one full-sequence forward instead (the trainer's shape), which with
invariant attention + kernel GEMM + "hf" ops gives the same bits. Rows sharing a step do not change a row's
bits where the arm's kernels are batch invariant (the aligned arm); elsewhere (cuBLAS) the bits can depend
on the padded batch size, so generate and score agree bitwise there only when their batches run alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minite import kernels
from minite.engines import sampler_ops as ops
from minite.engines.arms import Arm
from minite.engines.attention import invariant_attention
from minite.engines.decode_graphs import DecodeRunner, DecodeState
from minite.engines.sampler_weights import build_sampler_weights
from minite.kernels import fused_ops
from minite.tokenizer import EOS, PAD, CharTokenizer

#: decode steps between host checks for finished sequences (each check reads a few flags back)
CHECK_EVERY = 8


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
    def __init__(self, arm: Arm, model_cfg, device="cpu", max_batch: int = 64, max_seq_len: int | None = None,
                 cuda_graphs: bool = True):
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
        self.cuda_graphs = bool(cuda_graphs)   # used on CUDA devices; read at every generate / score
        self.rotary = ops.Rotary(c, self.recipe.non_gemm, self.max_seq_len, self.device)
        self.weights = None            # sampler_weights.SamplerWeights, set by load_weights (only through sync)
        self._cache = None             # (k, v) [L, max_batch + 1, kv_heads, max_seq, head_dim], on first use
        self._state = self._runner = None
        self.on_step = None            # optional callable(label): "start", "prefill", then once per decode step
        tok = model_cfg.get("tokenizer") if isinstance(model_cfg, dict) else None
        char_ok = tok == "char" and c.vocab_size <= CharTokenizer.vocab_size  # ids the char vocabulary knows
        self.tokenizer = CharTokenizer() if char_ok else None

    # ------------------------------------------------------------------------------------------ weights
    def load_weights(self, payload: dict) -> None:
        """Install weights from a sync payload (``trainer.export_weights()`` format, docs/ENGINES.md). Static
        activation scales from an earlier ``calibrate`` are kept (vLLM calibrates once, at start). When CUDA
        graphs are captured and the layout is unchanged, the new values are copied into the tensors the
        graphs read."""
        old = self.weights
        new = build_sampler_weights(payload, self.recipe, self.config, self.device)
        if old is not None:
            new.copy_amax_from(old)
        new.prepare(self.recipe)
        if old is not None and self._runner is not None and self._runner.graphs and old.copy_(new):
            return
        self.weights = new
        self._drop_graphs()

    def _drop_graphs(self):
        if self._runner is not None:
            self._runner.drop_graphs()

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
        self._decode_ready()
        calib = ops.Calibrator()
        for i in range(0, len(prompts), self.max_batch):
            chunk = prompts[i:i + self.max_batch]
            ids, lens = self._pad(chunk)
            valid = (torch.arange(ids.shape[1], device=self.device)[None, :] < lens[:, None]).reshape(-1)
            h, pend = self._layers(ids, self._prefill_positions(ids), self._slots(len(chunk)), calib=calib,
                                   valid=valid)
            self._logits(h, pend, rows=valid.nonzero().squeeze(-1), calib=calib)  # lm_head, if quantized
        w.set_amax(calib.amax)
        w.prepare(self.recipe)
        self._drop_graphs()  # the static scales are constants of the captured steps
        return dict(calib.amax)

    # ------------------------------------------------------------------------------------------ forward
    def _decode_ready(self) -> tuple[DecodeState, DecodeRunner]:
        """The KV cache, the decode state and its runner, allocated once (graphs hold their addresses)."""
        if self._cache is None:
            shape = (self.num_layers, self.max_batch + 1, self.n_kv, self.max_seq_len, self.head_dim)
            self._cache = (torch.zeros(shape, dtype=torch.bfloat16, device=self.device),
                           torch.zeros(shape, dtype=torch.bfloat16, device=self.device))
            self._state = DecodeState(self.max_batch, self.max_seq_len, self.device)
            self._runner = DecodeRunner(self._decode_step, self._state, self.max_batch, False)
        self._runner.cuda_graphs = self.cuda_graphs and self.device.type == "cuda"
        return self._state, self._runner

    def _slots(self, n: int) -> torch.Tensor:
        if n > self.max_batch:
            raise ValueError(f"batch of {n} sequences exceeds the sampler's max_batch={self.max_batch}")
        return torch.arange(n, device=self.device)

    def _prefill_positions(self, ids):
        b, t = ids.shape
        if t > self.max_seq_len:
            raise ValueError(f"{t} positions exceed the sampler's max_seq_len={self.max_seq_len}")
        return torch.arange(t, device=self.device)[None, :].expand(b, t)

    def _attention(self, li, lw, x, pos, slots, rope, decode, calib, valid, codes=None):
        """x [B, T, H] at positions pos [B, T] of cache slots [B] (``rope``: their rotary tables; ``codes``:
        x's, if its norm made them). ``decode``: (slot ids, sequence lengths) as int32 for one token per
        sequence against its cache row; else a prefill from position 0."""
        b, t, _ = x.shape
        qkv = ops.linear(x, lw.qkv, self.recipe, calib, valid, codes=codes)
        nq = self.n_q * self.head_dim
        kc, vc = self._cache[0][li], self._cache[1][li]            # [slots, kv, S, D]
        # q_norm / k_norm, rotary, and the keys and values into the cache at (slot, position), fused
        q, k = fused_ops.qk_norm_rope(qkv, self.n_q, self.n_kv, lw.q_norm, lw.k_norm, self.eps, *rope,
                                      self.recipe.non_gemm, cache=(kc, vc, slots, pos))
        invariant = self.recipe.attention == "invariant"
        if decode is not None:
            o = ops.decode_attention(q[:, :, 0], kc, vc, *decode, self.scaling,
                                     "invariant" if invariant else "fast")
        else:  # the prompt's own keys are all the keys (cache dtype: BF16, as computed)
            v = qkv[..., nq + self.n_kv * self.head_dim:].reshape(b, t, self.n_kv, self.head_dim).transpose(1, 2)
            keep = torch.arange(t, device=self.device)[None, None, None, :] <= pos[:, None, :, None]
            if invariant:
                o = invariant_attention(q, k, v, self.scaling, keep=keep)
            else:  # as transformers' sdpa attention with a mask: key/value heads repeated for the query heads
                rep = self.n_q // self.n_kv
                o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                   attn_mask=keep, scale=self.scaling).transpose(1, 2)
        return ops.linear(o.reshape(b, t, nq), lw.o, self.recipe, calib, valid)

    def _mlp(self, lw, x, calib, valid, cap, codes=None):
        b, t, h = x.shape
        x2 = x.reshape(-1, h)
        if lw.experts is None:  # a dense layer (mlp_only_layers / decoder_sparse_step)
            gate, up = ops.linear(x2, lw.gate_up, self.recipe, calib, valid, codes=codes).chunk(2, dim=-1)
            return ops.linear(ops.silu_mul(gate, up, self.recipe.non_gemm), lw.down, self.recipe, calib,
                              valid).reshape(b, t, h)
        logits, weights, idx = ops.router(x2, lw.router, self.config.num_experts_per_tok,
                                          self.config.norm_topk_prob, self.recipe, calib, valid, x.dtype)
        cap("router_logits", lambda: logits().reshape(b, t, -1))  # made only when captured
        cap("topk", idx.reshape(b, t, -1))
        # the k-sum left to the next norm, which takes it in its own pass (a tensor for any other reader)
        return ops.moe(x2, lw.experts, weights, idx, self.recipe, calib, valid, codes=codes, deferred_shape=(b, t, h))

    def _layers(self, ids, pos, slots, decode=None, capture=None, calib=None, valid=None, inputs=None):
        """ids [B, T] at positions pos [B, T] of cache slots [B] -> (residual stream, last block's output)
        [B, T, H], before the final norm (the output: a tensor, or the experts' ``RoutedRows`` with their k-sum
        left to that norm). ``capture(layer, op, positions, tensor)``: see ``score``. ``inputs``: (the
        embedding of ids, its rotary tables or None), where already gathered."""
        w = self.weights
        mode = self.recipe.non_gemm
        h, rope = inputs if inputs is not None else (F.embedding(ids, w.embed), None)
        rope = rope if rope is not None else self.rotary.tables(pos, h.dtype)
        pending = None  # the last block's output, added into the next norm (fused add + norm)
        for li, lw in enumerate(w.layers):
            def cap(op, tensor, _li=li):  # tensor: a tensor, or a function making it (only when capturing)
                if capture is not None:
                    capture(_li, op, pos, tensor() if callable(tensor) else tensor)
            # each norm's output is the input of NVFP4 linears: its last pass may also write their codes
            if pending is None:
                x, _, codes = ops.rms_norm_for_linears(h, lw.input_norm, self.eps, self.recipe, calib=calib,
                                                       next_lin=lw.qkv)
            else:
                x, h, codes = ops.rms_norm_for_linears(pending, lw.input_norm, self.eps, self.recipe, h, calib,
                                                       next_lin=lw.qkv)
            a = self._attention(li, lw, x, pos, slots, rope, decode, calib, valid, codes)
            cap("attn_out", a)
            x, h, codes = ops.rms_norm_for_linears(a, lw.post_norm, self.eps, self.recipe, h, calib)
            pending = self._mlp(lw, x, calib, valid, cap, codes)  # a tensor, or the experts' rows (ops.moe)
            cap("moe_out", lambda _p=pending: ops.value(_p))
            if capture is not None:  # the layer's output residual stream, as the next fused op will store it
                out = ops.value(pending)
                cap("residual", h + out if mode == "hf" else (h.float() + out.float()).to(h.dtype))
        return h, pending

    def _logits(self, h, pending, rows=None, calib=None, valid=None):
        """Final (fused add +) norm and lm_head on the selected rows [M] of the flattened [B*T] hidden, in the
        model's dtype (the kernels after it widen them to fp32 as they read them)."""
        hs = h.reshape(-1, self.hidden)
        if rows is not None:  # the last block's output taken whole (its k-sum too), then the selected rows
            hs, ps = hs[rows], ops.value(pending).reshape(-1, self.hidden)[rows]
        else:
            ps = pending.reshape(-1, self.hidden)
        x, _ = ops.add_rms_norm(ps, hs, self.weights.norm, self.eps, self.recipe.non_gemm)
        return ops.linear(x, self.weights.lm_head, self.recipe, calib, valid)

    def _prefill(self, ids, lens, slots, capture=None):
        """Prompts ids [B, P] (PAD after each prompt's lens) into cache slots [B] -> the logits [B, V] at each
        prompt's last token."""
        h, pend = self._layers(ids, self._prefill_positions(ids), slots, capture=capture)
        return self._logits(h, pend, torch.arange(ids.shape[0], device=self.device) * ids.shape[1] + lens - 1)

    def _emit(self, logits, slots, nxt, mode, advance=False, cells=None):
        """The token at position ``nxt`` of each row (drawn, or teacher-forced in mode "score") and its
        temperature-1 log-prob, recorded in the decode state's tables (``advance``: and fed as the rows' next
        input: ids = token, pos = nxt). ``cells``: the tables' (token, draw) at (slots, nxt), if read already."""
        st = self._state
        forced, draw = cells if cells is not None else (None, None)
        # the trainer's fp32 log-softmax bits, as torch's [B, V] result or (where reproduced) its rows'
        # statistics; the logits stay in the model's dtype, the kernels widen them as they read
        if mode in ("score", "greedy"):
            # (the argmax of the model's dtype: widening does not change the order)
            tok = logits.argmax(dim=-1) if mode == "greedy" else (st.tokens[slots, nxt] if forced is None else forced)
            logp = kernels.log_softmax_rows(logits)
        else:
            u = st.uniform[slots, nxt] if draw is None else draw
            if mode == "top_p":  # each row's max of the logits from the sampler's read, for the statistics
                tok, row_max = ops.sample_tokens_with_max(logits, st.temperature, st.top_p, u)
                logp = kernels.log_softmax_rows(logits, row_max=row_max)
            else:  # the token's pick and the statistics' sums in one launch
                tok, logp = ops.sample_tokens_with_log_softmax(logits, st.temperature, u)
        st.emit(tok, logp, slots, nxt, write_tokens=mode != "score", advance=advance)
        return tok

    def _decode_step(self, b: int, mode: str, capture=None) -> None:
        """One decode step over rows 0 .. b-1 of the decode state (``DecodeRunner``'s step function): feed
        each row's token at its position, emit the next one, advance. Static shapes, no host read."""
        st = self._state
        ids, pos, slots = st.ids[:b], st.pos[:b], st.slots[:b]
        at = pos[:, None]
        # one launch: the step's inputs, its embedding and its rotary rows (where a table holds them)
        table = self.rotary.gather_table(self.weights.embed.dtype)
        inp = kernels.step_inputs(pos, slots, st.tokens, st.uniform, self.max_seq_len - 1, embed=self.weights.embed,
                                  ids=ids, table=table)
        rope = None if table is None else (inp.rows[:, None, 0], inp.rows[:, None, 1])
        h, pend = self._layers(ids[:, None], at, slots, (inp.slot_ids, inp.seq_lens), capture,
                               inputs=(inp.hidden[:, None], rope))
        logits = self._logits(h, pend)  # in the model's dtype: half the bytes of fp32 for the tail to read
        if capture is not None:
            capture(-1, "logits", at, logits[:, None])
        # ids[:b] = the token, pos[:b] = nxt
        self._emit(logits, slots, inp.nxt, mode, advance=True, cells=(inp.forced, inp.draw))

    def _mark(self, label: str) -> None:
        if self.on_step is not None:
            self.on_step(label)

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
        ids = torch.full((len(prompts), max(len(p) for p in prompts)), PAD, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        return ids.to(self.device), lens

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
        b, n_new = len(prompts), int(max_new_tokens)
        slots = self._slots(b)
        mode = "greedy" if temperature == 0 else ("top_p" if top_p < 1 else "sample")
        st, runner = self._decode_ready()
        runner.prepare(mode)
        ids, lens = self._pad(prompts)
        st.reset_slots(b)
        st.tokens[:b, :ids.shape[1]] = ids
        st.temperature.fill_(max(float(temperature), 1e-30))
        st.top_p.fill_(float(top_p))
        st.stop.fill_(-1 if stop_token is None else int(stop_token))
        if mode != "greedy":  # every draw, up front: row i's token at position lens[i] + j takes draw [i, j]
            dev = generator.device if generator is not None else self.device
            draws = torch.rand((b, n_new), generator=generator, device=dev).to(self.device)
            st.uniform[slots[:, None], lens[:, None] + torch.arange(n_new, device=self.device)] = draws
        self._mark("start")
        tok = self._emit(self._prefill(ids, lens, slots), slots, lens, mode)
        self._mark("prefill")
        runner.start(list(range(b)), tok, lens)
        for step in range(1, n_new):
            if stop_token is not None and step % CHECK_EVERY == 0:  # between steps: who has stopped?
                stopped = st.stopped[st.slots[:len(runner.rows)]].tolist()
                live = [i for i, s in enumerate(stopped) if not s]
                if not live:
                    break
                runner.keep(live)
            runner.step(mode)
            self._mark("step")
        return self._assemble(prompts, n_new, stop_token)

    def _assemble(self, prompts, n_new, stop_token):
        """The output from the decode tables (one read): each response up to its first stop token."""
        b = len(prompts)
        table, lps = self._state.tokens[:b].cpu(), self._state.logprobs[:b].cpu()
        spans = []
        for i, p in enumerate(prompts):
            resp = table[i, len(p):len(p) + n_new]
            hit = (resp == stop_token).nonzero() if stop_token is not None else resp[:0]
            spans.append((len(p), int(hit[0]) + 1 if len(hit) else n_new))
        width = max(pl + n for pl, n in spans)
        tokens = torch.full((b, width), PAD, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        out_lp = torch.zeros((b, width), dtype=torch.float32)
        texts = [] if self.tokenizer is not None else None
        for i, (p, (pl, n)) in enumerate(zip(prompts, spans, strict=True)):
            tokens[i, :pl] = torch.as_tensor(p)
            tokens[i, pl:pl + n] = table[i, pl:pl + n]
            mask[i, pl:pl + n] = 1
            out_lp[i, pl:pl + n] = lps[i, pl:pl + n]
            if texts is not None:
                texts.append(self.tokenizer.decode(table[i, pl:pl + n]))
        lens = torch.tensor([pl for pl, _ in spans], dtype=torch.long)
        dev = self.device
        return GenerationOutput(tokens.to(dev), lens.to(dev), mask.to(dev), out_lp.to(dev), texts)

    @torch.no_grad()
    def score(self, tokens: torch.Tensor, prompt_lens, capture=None, path: str = "decode") -> torch.Tensor:
        """Log-probs [B, W] fp32 of tokens[b, t] for t >= prompt_lens[b] (0 on prompt positions), recomputed
        by teacher forcing through the decode step (``path="decode"``: prefill the prompt, then one token per
        step, as ``generate`` does; a row leaves the running batch once scored) or one full-sequence forward
        (``path="prefill"``). ``capture(layer, op, positions [B, T], tensor [B, T, ...])`` sees op in
        {"attn_out", "router_logits", "topk", "moe_out", "residual"} per layer and ("logits", layer -1) with
        the [B, 1, V] logits each step; with it the steps run eagerly and every row takes part in every step
        (a row past its last token is fed PAD; what it computes there is reported, at positions >= W, and
        not scored)."""
        self._need_weights()
        tokens = torch.as_tensor(tokens, device=self.device).long()
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected [B, W], got shape {tuple(tokens.shape)}")
        b, width = tokens.shape
        lens_l = torch.as_tensor(prompt_lens).long().reshape(-1).tolist()
        if len(lens_l) != b or min(lens_l) < 1 or max(lens_l) > width:
            raise ValueError("prompt_lens: one length per row, each in [1, W]")
        if width > self.max_seq_len:
            raise ValueError(f"sequence width {width} exceeds max_seq_len={self.max_seq_len}")
        if path not in ("decode", "prefill"):
            raise ValueError(f"path must be 'decode' or 'prefill', not {path!r}")
        lens = torch.tensor(lens_l, dtype=torch.long, device=self.device)
        slots = self._slots(b)
        st, runner = self._decode_ready()
        if path == "prefill":
            pos = self._prefill_positions(tokens)
            h, pend = self._layers(tokens, pos, slots, capture=capture)
            logits = self._logits(h, pend).reshape(b, width, -1)
            if capture is not None:
                capture(-1, "logits", pos, logits)
            lp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
            keep = torch.arange(1, width, device=self.device)[None, :] >= lens[:, None]
            out = torch.zeros((b, width), dtype=torch.float32, device=self.device)
            out[:, 1:] = torch.where(keep, lp, torch.zeros_like(lp))
            return out
        if capture is None:
            runner.prepare("score")
        st.reset_slots(b, end=width)
        st.tokens[:b, :width] = tokens
        ids = torch.where(torch.arange(max(lens_l), device=self.device)[None, :] < lens[:, None],
                          tokens[:, :max(lens_l)], PAD)
        logits = self._prefill(ids, lens, slots, capture)
        if capture is not None:
            capture(-1, "logits", (lens - 1)[:, None], logits[:, None])

            def step_capture(layer, op, pos, t):  # the real rows, in their original order
                return capture(layer, op, pos[:b], t[:b])
        tok = self._emit(logits, slots, lens, "score")
        runner.start(list(range(b)), tok, lens.clamp_max(self.max_seq_len - 1))
        need = [width - 1 - n for n in lens_l]  # decode steps each row needs (its last token predicts none)
        for step in range(max(need)):
            if capture is None:
                runner.keep([i for i, slot in enumerate(runner.rows) if need[slot] > step])
                runner.step("score")
            else:  # every row, every step, eagerly: the hook sees the batch in its original order
                runner.step("score", step_capture)
        return st.logprobs[:b, :width].clone()
