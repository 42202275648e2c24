"""The trainer's NVFP4 linears: weight quantizers, forward/backward autograd, and the modules that replace
HF's ``nn.Linear`` projections and quantize the router.

Forward (per ``EngineRecipe``): ``y = x W^T`` with x quantized per ``recipe.activations`` (1x16, RNE) and W
per ``recipe.weights`` (formula "te", 16x16 tiles), then ``minite.engines.gemm`` on ``recipe.gemm``.

Backward, Transformer Engine's NVFP4 gradient treatment:
    dgrad  dx = dy W        dy quantized 1x16 along N with ``backward_rounding`` (stochastic in TE);
                            W in its quantized form (16x16 tiles make W and W^T the same codes).
    wgrad  dW = dy^T x      both operands quantized 1x16 along the token (reduction) dimension, with the
                            16-point RHT when ``backward_rht``; dy with ``backward_rounding``, x with RNE.
    Backward operands use one dynamic amax per tensor (TE's recipe). Their GEMMs follow ``recipe.gemm``:
    "kernel" (the W4A4 arm) runs them on the NVFP4 operands (``minite.kernels``: exact products, fp32
    accumulation; W^T from W's 16x16 tiles, ``backward_gemm``), as TE's recipe does on FP4 tensor cores;
    "emulated" (TE's structure on Hopper) multiplies the dequantized BF16 values. A W in 1x16 blocks (N % 16
    != 0) has no 1x16 transpose: its dgrad runs on the BF16 values under either.
    Token counts are zero-padded to a multiple of 16 for the wgrad blocks (zero rows add nothing, and the
    Hadamard transform is orthogonal, so padding does not change the product).

Weight caching (``QuantState.cache_per_update``): the naive arm re-quantizes W from the BF16 master on every
forward (TE's default); the minite arm quantizes once per update — a cache keyed on ``QuantState.version``,
which the trainer bumps after each optimizer step — and those cached codes are exactly what
``Trainer.export_weights`` ships. Weights whose N is not a multiple of 16 (a tiny model's router) fall back
to 1x16 blocks; K % 16 != 0 raises.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from minite import nvfp4
from minite.engines import gemm as G
from minite.engines.arms import EngineRecipe, QuantSpec
from minite.engines.gemm import hp_linear
from minite import kernels as _kernels


_NO_TIMING = contextlib.nullcontext()


class QuantState:
    """What every NVFP4 module of one trainer shares: the recipe, the update counter the weight cache is
    keyed on, the generator stochastic rounding draws its seeds from, and counters for timing reports."""

    def __init__(self, recipe: EngineRecipe, cache_per_update: bool, seed: int = 0):
        self.recipe = recipe
        # gemm "te": TE runs the dense linears; minite's own modules (experts) emulate TE's structure
        self.gemm = "emulated" if recipe.gemm == "te" else recipe.gemm
        self.cache_per_update = cache_per_update
        self.version = 0
        self.generator = torch.Generator().manual_seed(int(seed) + 7919)  # CPU: only draws SR seeds
        self.weight_quantizations = 0        # weight tensors quantized (one per module per quantization)
        self.act_quantizations = 0           # activation / gradient tensors quantized
        self.cuda = False                    # set by the trainer: time with CUDA events instead of the host clock
        self.split_timing = True             # time the quantize / gemm blocks (``timed``)
        self._host = defaultdict(float)
        self._events = defaultdict(list)
        self._free_events: list = []         # recorded and read: reusable

    def bump(self) -> None:
        """The master weights changed (optimizer step / load): cached codes are stale."""
        self.version += 1

    def timed(self, key: str, what: str = ""):
        """A context that accumulates the time of its block under ``key`` ("quantize" / "gemm") while
        ``split_timing`` is on: CUDA events on the GPU (no sync here; ``collect`` syncs once), the host clock on
        CPU (where ops are synchronous). While a profiler runs (bench-learner --torch-profile) the block is also
        a range ``minite.<key>[.<what>]``. A learner update has ~1,400 such blocks and a kernel-path update is
        bound by its host, so timing them costs update time: with ``split_timing`` off and no profiler this is
        one shared no-op context."""
        profiling = torch._C._autograd._profiler_enabled()
        if not (self.split_timing or profiling):
            return _NO_TIMING
        return self._timed(key, what, profiling)

    @contextlib.contextmanager
    def _timed(self, key: str, what: str, profiling: bool):
        rng = (torch.profiler.record_function(f"minite.{key}" + (f".{what}" if what else ""))
               if profiling else contextlib.nullcontext())
        with rng:
            if not self.split_timing:
                yield
            elif self.cuda:
                e0, e1 = self._event(), self._event()
                e0.record()
                yield
                e1.record()
                self._events[key].append((e0, e1))
            else:
                t0 = time.perf_counter()
                yield
                self._host[key] += time.perf_counter() - t0

    def _event(self):
        return self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)

    def collect(self) -> dict[str, float]:
        """Seconds per key since the last collect (syncs the GPU once), then reset."""
        out = dict(self._host)
        if self._events:
            torch.cuda.synchronize()
            for key, pairs in self._events.items():
                out[key] = out.get(key, 0.0) + sum(a.elapsed_time(b) for a, b in pairs) / 1e3
                self._free_events.extend(e for pair in pairs for e in pair)
        self._host.clear()
        self._events.clear()
        return out


# ------------------------------------------------------------------------------------------- weights
@dataclass
class QWeight:
    """Quantized weight(s): codes uint8 [(E,) N, K/2], scales e4m3 [(E,) N, K/16], global_scale fp32
    [(E,)] or [(E,) N] (per-shard scales spelled out per row), and ``dq`` = the dequantized BF16 values
    (what the emulated GEMMs, and dgrad off the codes path, use)."""

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    dq: torch.Tensor
    prepared: object = None      # minite.kernels' one-time re-layout (prepare_weight / prepare_experts)
    tile: tuple[int, int] = (16, 16)
    shards: int = 1              # fused pieces along N with a global scale each (gate/up, per_shard)
    _transposed: object = field(default=None, repr=False)

    def tensor(self, e: int | None = None) -> nvfp4.NVFP4Tensor:
        if e is None:
            return nvfp4.NVFP4Tensor(self.codes, self.scales, self.global_scale)
        return nvfp4.NVFP4Tensor(self.codes[e], self.scales[e], self.global_scale[e])

    def tensors(self) -> list[nvfp4.NVFP4Tensor]:
        return [self.tensor(e) for e in range(self.codes.shape[0])]

    def experts(self):
        """The stacked form minite.kernels.grouped_nvfp4_gemm takes (pre-decoded when prepared)."""
        if self.prepared is not None:
            return self.prepared
        return _kernels.NVFP4Experts(self.codes, self.scales, self.global_scale)

    def gemm_weight(self):
        """What the dense kernel GEMM takes: the prepared weight when there is one (same bits, faster)."""
        return self.prepared if self.prepared is not None else self.tensor()

    def dgrad_weight(self):
        """W^T in 1x16 blocks along N for dgrad on NVFP4 operands (``kernels.transpose_weight`` /
        ``transpose_experts``: the same codes and scales), made once per cached weight, and re-laid out for
        large M when W is (``prepare``: the per-update cache); None for a W in 1x16 blocks (its transpose
        would need new scales)."""
        if self.tile != (16, 16):
            return None
        if self._transposed is None:
            if self.codes.dim() == 2:
                t = _kernels.transpose_weight(self.tensor())
                self._transposed = _kernels.prepare_weight(t) if self.prepared is not None else t
            else:
                t = _kernels.transpose_experts(_kernels.NVFP4Experts(self.codes, self.scales, self.global_scale),
                                               self.shards)
                self._transposed = _kernels.prepare_experts(t) if self.prepared is not None else t
        return self._transposed

    def prepare(self) -> None:
        """minite.kernels' large-M re-layout (a pre-decoded fp16 copy on the Triton path; a no-op on CPU).
        Worth it only for weights reused across many GEMMs: the per-update cache."""
        if self.codes.dim() == 2:
            self.prepared = _kernels.prepare_weight(self.tensor())
        else:
            self.prepared = _kernels.prepare_experts(self.experts())


def _weight_tile(spec: QuantSpec, n: int) -> tuple[int, int]:
    return tuple(spec.tile) if n % 16 == 0 else (1, 16)


def quantize_weight(w: torch.Tensor, spec: QuantSpec, shards: int = 1) -> QWeight:
    """w [N, K] or [E, N, K] (BF16 master) -> QWeight. ``shards``: fused pieces along N (2 for gate/up);
    with ``spec.fused_shards == "per_shard"`` each keeps its own global scale, else one over all of them.
    Formula "te" with tensor scaling (every arm's trainer weights) is one amax pass and one cast pass for all
    experts and shards (``minite.kernels.quantize_weight_groups``: codes, scales and the BF16 values, each
    group bit-equal to ``nvfp4.quantize(piece, formula="te", scaling="tensor")``)."""
    squeeze = w.dim() == 2
    w3 = w.detach().unsqueeze(0) if squeeze else w.detach()
    e, n, k = w3.shape
    if k % 16:
        raise ValueError(f"NVFP4 weight needs K % 16 == 0, got K = {k}")
    nshard = shards if spec.fused_shards == "per_shard" else 1
    tile = _weight_tile(spec, n // nshard)
    if spec.formula == "te" and spec.scaling == "tensor":  # NaN/Inf raise from the amax pass
        codes, scales, gdec, dq = _kernels.quantize_weight_groups(w3.reshape(e * n, k), e * nshard, tile)
        codes, scales, dq = codes.view(e, n, k // 2), scales.view(e, n, k // 16), dq.view(e, n, k)
        gdec = gdec.view(e, nshard).repeat_interleave(n // nshard, dim=1) if nshard > 1 else gdec
    else:  # other formulas: the reference quantizer, one call per (expert, shard)
        nvfp4.check_finite(w3, "weight")
        parts = [[nvfp4.quantize(piece, **{**spec.quantize_kwargs(), "tile": tile})
                  for piece in w3[i].chunk(nshard, dim=0)] for i in range(e)]
        codes = torch.stack([torch.cat([p.codes for p in ps]) for ps in parts])
        scales = torch.stack([torch.cat([p.scales for p in ps]) for ps in parts])
        gdec = torch.stack([torch.cat([p.row_global_scale() for p in ps]) for ps in parts])
        if nshard == 1:
            gdec = gdec[:, 0].contiguous()      # one scalar per weight (per expert)
        vals = nvfp4.e2m1_decode(nvfp4.unpack_codes(codes.view(e * n, k // 2))).view(e, n, k // 16, 16)
        g = gdec if gdec.dim() == 1 else gdec[..., None]
        dq = ((vals * scales.to(torch.float32)[..., None]).view(e, n, k) * g.view(e, -1, 1)).to(torch.bfloat16)
    if squeeze:
        return QWeight(codes[0], scales[0], gdec[0], dq[0], tile=tuple(tile))
    return QWeight(codes, scales, gdec, dq, tile=tuple(tile), shards=nshard)


class WeightCache:
    """Per-module cached QWeight: valid for one ``QuantState.version`` when caching per update."""

    def __init__(self, state: QuantState, spec: QuantSpec, shards: int = 1):
        self.state, self.spec, self.shards = state, spec, shards
        self._version, self._q = None, None

    def get(self, w: torch.Tensor) -> QWeight:
        st = self.state
        if st.cache_per_update and self._q is not None and self._version == st.version:
            return self._q
        with torch.no_grad(), st.timed("quantize", "weight"):
            q = quantize_weight(w, self.spec, self.shards)
            if st.cache_per_update and st.gemm == "kernel" and w.is_cuda:
                q.prepare()
        st.weight_quantizations += 1
        if st.cache_per_update:
            self._version, self._q = st.version, q
        return q


# --------------------------------------------------------------------------------- activations / grads
# Backward operands: tensor amax, formula "te", 1x16 blocks; no NaN check per call (a host sync each): the
# update's grad-norm check catches NaN/Inf gradients before any optimizer step. Each is one call of
# minite.kernels (an amax pass and one cast pass that writes the NVFP4 codes the kernel GEMMs read, or on the
# emulated path the BF16 values its GEMMs multiply).
def quantize_act(x2d: torch.Tensor, state: QuantState) -> nvfp4.NVFP4Tensor:
    """Forward activations per the recipe (gemm.quantize_activation: minite.kernels on CUDA), timed."""
    state.act_quantizations += 1
    with state.timed("quantize", "act"):
        return G.quantize_activation(x2d, state.recipe.activations)


def qdq_act(x2d: torch.Tensor, state: QuantState) -> torch.Tensor:
    """BF16 values of the quantized activations (the emulated GEMM's operand), written by the cast itself:
    bit-identical to ``nvfp4.dequantize(quantize_act(x2d, state)).bfloat16()``."""
    state.act_quantizations += 1
    with state.timed("quantize", "act"):
        return _kernels.quantize_dequantize(x2d, torch.bfloat16, check=False,
                                            **state.recipe.activations.quantize_kwargs())


def _grad_cast(x, state: QuantState, rounding: str, rht: bool, dequantized: bool, **operand):
    """A backward operand in 1x16 blocks, tensor amax, formula "te": NVFP4 codes, or (``dequantized``) the
    BF16 values the emulated GEMMs multiply. SR seeds come from the trainer's generator, in call order."""
    state.act_quantizations += 1
    kw = dict(formula="te", tile=(1, 16), scaling="tensor", rounding=rounding, rht=rht, check=False,
              generator=state.generator if rounding == "stochastic" else None, **operand)
    with state.timed("quantize", "grad"):
        if dequantized:
            return _kernels.quantize_dequantize(x, torch.bfloat16, **kw)
        return _kernels.quantize(x, **kw)


def qdq_grad(x2d: torch.Tensor, state: QuantState, rounding: str, rht: bool = False) -> torch.Tensor:
    """Quantize-dequantize a backward operand [M, K] in 1x16 blocks along K -> BF16 [M, K].
    K % 16 != 0 (a tiny router's N = 8 as dgrad's K) leaves it in BF16."""
    if x2d.shape[1] % 16:
        return x2d.to(torch.bfloat16)
    return _grad_cast(x2d, state, rounding, rht, True)


def quantize_tokens(x2d: torch.Tensor, state: QuantState, rounding: str, rht: bool,
                    gather: torch.Tensor | None = None, dequantized: bool = False):
    """A wgrad operand: x2d [M, C] quantized along the token dimension -> [C, M'] (NVFP4, or BF16 values
    when ``dequantized``), i.e. of ``pad16(x2d).t()`` (or, with ``gather``, of ``x2d[gather].t()``, -1 = a
    zero token) read straight from x2d: no padding copy, no transpose copy."""
    width = None if gather is not None else -(-x2d.shape[0] // 16) * 16
    return _grad_cast(x2d.t(), state, rounding, rht, dequantized, width=width, gather=gather)


def wgrad_operands(dy2d: torch.Tensor, x2d: torch.Tensor, state: QuantState, dequantized: bool,
                   gather: torch.Tensor | None = None):
    """(dy^T, x^T) quantized along the token dimension ([N, M'], [K, M'], M' = M padded to a multiple of 16
    with zero tokens, or the ``gather`` layout): dy with the recipe's rounding, x with RNE, both with its RHT."""
    r = state.recipe
    return (quantize_tokens(dy2d, state, r.backward_rounding, r.backward_rht, gather, dequantized),
            quantize_tokens(x2d, state, "nearest", r.backward_rht, gather, dequantized))


def dgrad_on_codes(state: QuantState, qw: QWeight, dy: torch.Tensor) -> bool:
    """dgrad runs on NVFP4 operands (``dgrad_nvfp4``): the arm's GEMM is the W4A4 kernel and W's 16x16 tiles
    give a 1x16 W^T (``QWeight.dgrad_weight``, built there). wgrad needs only the kernel."""
    return state.gemm == "kernel" and dy.shape[1] % 16 == 0 and qw.tile == (16, 16)


def dgrad_nvfp4(dy: torch.Tensor, qw: QWeight, state: QuantState, out_dtype,
                offsets: torch.Tensor | None = None) -> torch.Tensor:
    """dx = dy W on NVFP4 operands: dy quantized 1x16 along N with the recipe's rounding, W^T from W's tiles;
    ``offsets``: the experts' grouped GEMM (fused pieces with their own scales as K segments)."""
    dyq = _grad_cast(dy, state, state.recipe.backward_rounding, False, False)
    wt = qw.dgrad_weight()
    with state.timed("gemm"):
        if offsets is None:
            return _kernels.nvfp4_gemm(dyq, wt, out_dtype=out_dtype)
        return _kernels.grouped_nvfp4_gemm(dyq, wt, offsets, out_dtype=out_dtype,
                                           k_segments=wt.global_scale.shape[1] if wt.global_scale.dim() == 2 else 1)


def forward_gemm(x2d: torch.Tensor, qw: QWeight, state: QuantState, out_dtype) -> torch.Tensor:
    """Quantize x per the activation spec, then the recipe's GEMM with the quantized weight."""
    if state.gemm == "emulated":  # == gemm.nvfp4_gemm("emulated"), reusing the dequantized weight
        a = qdq_act(x2d, state)
        with state.timed("gemm"):
            return torch.matmul(a, qw.dq.T).to(out_dtype)
    a = quantize_act(x2d, state)
    with state.timed("gemm"):
        # the epilogue rounds its fp32 result to out_dtype (every path rounds to fp32 first): the bits of
        # gemm.nvfp4_linear, the op the sampler runs, without an fp32 buffer and a cast pass
        return G.nvfp4_gemm(a, qw.gemm_weight(), state.gemm, out_dtype=out_dtype)


class _NVFP4LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, qw: QWeight, state: QuantState):
        ctx.state, ctx.qw = state, qw
        ctx.save_for_backward(x2d)
        return forward_gemm(x2d, qw, state, out_dtype=x2d.dtype)

    @staticmethod
    def backward(ctx, dy):
        (x2d,) = ctx.saved_tensors
        st, qw = ctx.state, ctx.qw
        dx = dw = None
        if ctx.needs_input_grad[0]:
            if dgrad_on_codes(st, qw, dy):
                dx = dgrad_nvfp4(dy, qw, st, x2d.dtype)
            else:
                dyq = qdq_grad(dy, st, st.recipe.backward_rounding)
                with st.timed("gemm"):
                    dx = torch.matmul(dyq, qw.dq).to(x2d.dtype)
        if ctx.needs_input_grad[1]:
            dyt, xt = wgrad_operands(dy, x2d, st, dequantized=st.gemm != "kernel")
            with st.timed("gemm"):
                if st.gemm == "kernel":
                    dw = _kernels.nvfp4_gemm(dyt, xt, out_dtype=qw.dq.dtype)
                else:
                    dw = torch.matmul(dyt, xt.T).to(qw.dq.dtype)
        return dx, dw, None, None


def nvfp4_linear_fn(x: torch.Tensor, weight: torch.Tensor, qw: QWeight, state: QuantState) -> torch.Tensor:
    k = x.shape[-1]
    y = _NVFP4LinearFn.apply(x.reshape(-1, k), weight, qw, state)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class NVFP4Linear(nn.Module):
    """Drop-in for a bias-free ``nn.Linear``: same ``weight`` Parameter (so HF parameter names and hooks
    are unchanged), NVFP4 forward/backward per the trainer recipe."""

    def __init__(self, weight: nn.Parameter, state: QuantState):
        super().__init__()
        n, k = weight.shape
        if k % 16:
            raise ValueError(f"NVFP4Linear needs in_features % 16 == 0, got {k}")
        self.in_features, self.out_features = k, n
        self.weight = weight
        self.state = state
        self.cache = WeightCache(state, state.recipe.weights)

    @classmethod
    def from_linear(cls, lin: nn.Linear, state: QuantState) -> "NVFP4Linear":
        if lin.bias is not None:
            raise ValueError("NVFP4Linear: Qwen3-MoE projections have no bias")
        return cls(lin.weight, state)

    def quantized(self) -> QWeight:
        return self.cache.get(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nvfp4_linear_fn(x, self.weight, self.quantized(), self.state)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nvfp4"


def _topk_route(router, router_logits):
    """HF Qwen3MoeTopKRouter's routing on given logits: fp32 softmax, top-k, optional renormalisation."""
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, router.top_k, dim=-1)
    if router.norm_topk_prob:
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value.to(router_logits.dtype), router_indices


def make_router(base_cls):
    """A subclass of HF's ``Qwen3MoeTopKRouter`` whose logits GEMM is NVFP4 (same ``weight`` Parameter,
    same softmax / top-k / renormalisation as upstream; isinstance checks and output recorders still see
    an HF router)."""

    class NVFP4TopKRouter(base_cls):
        def attach(self, state: QuantState):
            self.state = state
            self.cache = WeightCache(state, state.recipe.weights)
            return self

        def quantized(self) -> QWeight:
            return self.cache.get(self.weight)

        def forward(self, hidden_states):
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
            return _topk_route(self, nvfp4_linear_fn(hidden_states, self.weight, self.quantized(), self.state))

    return NVFP4TopKRouter


def make_invariant_router(base_cls):
    """HF's router with its BF16 logits GEMM batch-invariant on log-prob paths (``gemm.hp_linear``)."""

    class InvariantTopKRouter(base_cls):
        def forward(self, hidden_states):
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
            return _topk_route(self, hp_linear(hidden_states, self.weight, True))

    return InvariantTopKRouter


class InvariantLinear(nn.Linear):
    """A BF16 ``nn.Linear`` (lm_head) whose GEMM is batch-invariant on log-prob paths (``gemm.hp_linear``)."""

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> "InvariantLinear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight, new.bias = lin.weight, lin.bias
        return new

    def forward(self, x):
        return hp_linear(x, self.weight, True, self.bias)
