"""``python -m minite.kernels.bench`` / ``python -m minite kernel-bench``: check, then time, the NVFP4 kernels.

Checks first (GPU): quantizer bit-exactness vs minite.nvfp4 in every mode, GEMM vs nvfp4_matmul_reference
(rel. error in fp32 output), batch invariance (a row alone == the same row inside M=16384, across the M
configs), determinism (two runs), grouped GEMM vs per-expert reference. Then timings, providers side by side
in the same run: cuBLAS bf16 (torch.matmul), fp8 torch._scaled_mm, naive emulation (dequantize both to bf16,
then matmul), torch._grouped_mm bf16 (MoE), ours. Medians from triton.testing (CUDA-graph replays by default,
so Python launch overhead is out of every provider's numbers; --no-graph uses do_bench), inputs rotated over
copies larger than L2. ``run`` hands long-format rows and a markdown summary to its caller's ``publish``
after every group (the CLI job ``minite kernel-bench`` writes them with provenance).

Decode regime: M = 1..64 on every shape and grouped GEMMs at 1/8/16/64 tokens x top-8 (random routing, exact
per-expert counts); ``gbps`` is the bytes a provider must move (its operands in its own format, read once,
plus the output) over its time.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import math
import sys

import torch

from minite import nvfp4 as ref

from . import checks
from .gemm import (GROUPED_F16_CONFIG, PreparedWeight, config_for, grouped_config_for, grouped_nvfp4_gemm,
                   nvfp4_gemm, prepare_experts, prepare_weight, stack_experts)
from .weights import NVFP4Experts, decode_layout
from .quantize import quantize

L2_BYTES = 60 * 2 ** 20
# Qwen3-30B-A3B projections (hidden 2048) as (name, N, K), plus a square one; expert gate_up is the fused
# gate + up projection (2 x 768 rows)
SHAPES = [("q_proj", 4096, 2048), ("k_proj", 512, 2048), ("v_proj", 512, 2048), ("o_proj", 2048, 4096),
          ("expert_gate_up", 1536, 2048), ("expert_down", 2048, 768), ("router", 128, 2048),
          ("square8192", 8192, 8192)]
DECODE_MS = [1, 2, 4, 8, 16, 32, 64]
MS = DECODE_MS + [128, 1024, 4096, 16384]
QUICK_SHAPES = [("q_proj", 4096, 2048), ("square8192", 8192, 8192)]
QUICK_MS = [1, 16, 4096]
GROUPED = [("moe_gate_up", 1536, 2048), ("moe_down", 2048, 768)]
DECODE_TOKENS = [1, 8, 16, 64]  # x top-8 over 128 experts: <= 16 rows per expert
DEFAULT_OUT, DRY_RUN_OUT = "results/h200/kernels.csv", "results/dry-run/kernels.csv"


def add_args(p: argparse.ArgumentParser) -> None:
    # a dry run's untimed CPU rows must never land where the h200 pipeline reads real results
    p.add_argument("--out", default=None, help="long-format CSV, the .md goes beside (default "
                   f"{DEFAULT_OUT}; {DRY_RUN_OUT} with --dry-run)")
    p.add_argument("--quick", action="store_true", help="few shapes")
    p.add_argument("--no-graph", action="store_true", help="time with do_bench instead of CUDA-graph replays")
    p.add_argument("--rep", type=float, default=60.0, help="ms of timed repeats per point")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--sweep", action="store_true", help="also time alternative tile configs of ours")
    p.add_argument("--k-chunk", type=int, default=0, metavar="KC",
                   help="also time ours under the K-chunk contract (gemm.k_chunk, KC-wide chunks) right after the "
                        "one-chain default at every point (providers ours_kcKC, ours_prepared_kcKC), and check its "
                        "decode batch invariance first")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes, every provider called once, no timing (a CPU smoke test of the pipeline)")


def default_out(args) -> str:
    return DRY_RUN_OUT if getattr(args, "dry_run", False) else DEFAULT_OUT


def check_args(args) -> None:
    """Refuse what a real run could not time (ValueError); dry runs too, being smoke tests of real commands."""
    if args.rep <= 0:
        raise ValueError(f"--rep must be > 0 (ms of timed repeats per point), got {args.rep}")


class Timer:
    def __init__(self, graph: bool, rep: float):
        import triton.testing as tt
        self.tt, self.graph, self.rep = tt, graph, rep

    def __call__(self, make, nbytes: int):
        """make(i) -> zero-arg callable on input copy i; copies rotate so the working set exceeds L2."""
        n_rot = max(1, min(64, math.ceil(2 * L2_BYTES / max(1, nbytes))))
        fns = [make(i) for i in range(n_rot)]
        for f in fns:  # warm-up: compile, autotune-free, allocator settled
            f()
        torch.cuda.synchronize()
        cyc = itertools.cycle(fns)

        def step():
            next(cyc)()
        reps = max(n_rot, 1)
        if self.graph:
            return self.tt.do_bench_cudagraph(lambda: [step() for _ in range(reps)], rep=self.rep,
                                              return_mode="median") / reps
        return self.tt.do_bench(step, warmup=25, rep=self.rep, return_mode="median")


def _naive_deq(t, table):
    m = t.codes.shape[0]
    lo, hi = t.codes & 0xF, t.codes >> 4
    vals = table[torch.stack([lo, hi], -1).view(m, -1).long()].view(m, -1, 16)
    blk = vals * t.scales.to(torch.float32)[..., None]
    g = t.global_scale
    return (blk * (g if g.dim() == 0 else g[:, None, None])).view(m, -1).to(torch.bfloat16)


def _copies(obj, n):
    """obj and n-1 clones (a tensor, an NVFP4Tensor or an NVFP4Experts): distinct addresses to rotate over."""
    def clone(o):
        if isinstance(o, torch.Tensor):
            return o.clone()
        if isinstance(o, PreparedWeight):
            return PreparedWeight(clone(o.w), *(None if t is None else t.clone() for t in (o.f16, o.frag)))
        if isinstance(o, NVFP4Experts):
            return NVFP4Experts(*(None if t is None else t.clone() for t in (o.codes, o.scales, o.global_scale,
                                                                               o.f16, o.frag)))
        return type(o)(o.codes.clone(), o.scales.clone(), o.global_scale.clone())
    return [obj] + [clone(obj) for _ in range(n - 1)]


def on_copy(sets, fn):
    """The timer's ``make``: i -> a zero-argument call of fn on input copy i. The timer picks how many copies
    to rotate over (up to 64); a provider that made fewer wraps around them."""
    return lambda i: functools.partial(fn, *sets[i % len(sets)])


@contextlib.contextmanager
def k_chunk_contract(kc: int):
    """Everything inside runs under the K-chunk contract ``kc`` (0: one chain); the environment's after."""
    from . import gemm
    gemm.set_k_chunk(kc)
    try:
        yield
    finally:
        gemm.set_k_chunk(None)


def _under(kc: int, fn):
    """fn, each call made under the K-chunk contract ``kc`` (None: as it is)."""
    if kc is None:
        return fn

    def call(*args, **kwargs):
        with k_chunk_contract(kc):
            return fn(*args, **kwargs)
    return call


def _with_k_chunk(providers: list[str], kc: int) -> list[str]:
    """Each of ours followed by its twin under the K-chunk contract (ours_kcKC), when kc > 0."""
    return [q for p in providers for q in ((p, f"{p}_kc{kc}") if kc and p.startswith("ours") else (p,))]


def _split_kc(provider: str) -> tuple[str, int | None]:
    """"ours_prepared_kc512" -> ("ours_prepared", 512); a provider without the suffix -> (it, None)."""
    base, sep, kc = provider.rpartition("_kc")
    return (base, int(kc)) if sep and kc.isdigit() else (provider, None)


def _nbytes(*ts):
    tot = 0
    for t in ts:
        if isinstance(t, torch.Tensor):
            tot += t.numel() * t.element_size()
        elif isinstance(t, PreparedWeight):
            tot += _nbytes(t.f16)
        else:
            tot += _nbytes(t.codes, t.scales, t.global_scale)
    return tot


def bench_dense(timer, name, n, k, m, dev, rows, sha, devname, sweep, kc=0):
    x = torch.randn(m, k, device=dev)
    w32 = torch.randn(n, k, device=dev)
    a, w = quantize(x, scaling="row"), quantize(w32)
    pw = decode_layout(prepare_weight(w))  # prepared: f16 for large M, fragment order for the decode kernel
    a16, w16 = ref.dequantize(a).bfloat16(), ref.dequantize(w).bfloat16()
    table = torch.tensor(ref.E2M1_VALUES, device=dev)
    flops = 2.0 * m * n * k
    out_b = m * n * 2
    mp = max(m, 16)  # _scaled_mm wants M % 16 == 0
    a8 = torch.zeros(mp, k, device=dev, dtype=torch.float8_e4m3fn)
    a8[:m] = (a16.float() / a16.float().abs().amax() * 400).to(torch.float8_e4m3fn)
    w8 = (w16.float() / w16.float().abs().amax() * 400).to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    per_set = {
        "cublas_bf16": _nbytes(a16, w16) + out_b,
        "fp8_scaled_mm": _nbytes(a8, w8) + mp * n * 2,
        "naive_emulation": _nbytes(a, w) + out_b,
        "ours": _nbytes(a, w) + out_b,
        "ours_prepared": _nbytes(a, w, pw) + out_b,
    }

    def mk(provider, cfg=None):
        provider, contract = _split_kc(provider)
        gemm = _under(contract, nvfp4_gemm)
        n_rot = max(1, min(64, math.ceil(2 * L2_BYTES / per_set[provider])))
        if provider == "cublas_bf16":
            sets = list(zip(_copies(a16, n_rot), _copies(w16, n_rot)))
            return on_copy(sets, lambda x, w: torch.matmul(x, w.T))
        if provider == "fp8_scaled_mm":
            sets = list(zip(_copies(a8, n_rot), _copies(w8, n_rot)))
            return on_copy(sets, lambda x, w: torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one,
                                                               out_dtype=torch.bfloat16))
        if provider == "ours_prepared" or (cfg and cfg.get("variant") in PREPARED_VARIANTS):
            n_rot = max(1, min(64, math.ceil(2 * L2_BYTES / per_set["ours_prepared"])))
            sets = list(zip(_copies(a, n_rot), _copies(pw, n_rot)))
            return on_copy(sets, lambda x, w: gemm(x, w, config=cfg))
        sets = list(zip(_copies(a, n_rot), _copies(w, n_rot)))
        if provider == "naive_emulation":
            return on_copy(sets, lambda x, w: _naive_deq(x, table) @ _naive_deq(w, table).T)
        return on_copy(sets, lambda x, w: gemm(x, w, config=cfg))

    providers = _with_k_chunk(["cublas_bf16", "fp8_scaled_mm", "naive_emulation", "ours", "ours_prepared"], kc)
    cfgs = [(p, None) for p in providers]
    if sweep:
        cfgs += [("ours", c) for c in SWEEPS.get((name, m), [])]
    for provider, cfg in cfgs:
        label = provider if cfg is None else "ours:" + _cfg_name(cfg)
        base, contract = _split_kc(provider)
        nbytes = per_set[base if cfg is None or cfg["variant"] not in PREPARED_VARIANTS else "ours_prepared"]
        try:
            ms = timer(mk(provider, cfg), nbytes)
        except Exception as exc:  # record, keep going: one provider's failure must not lose the run
            print(f"  {label} {name} M={m}: FAILED {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            ms = float("nan")
        config = (_cfg_name(cfg) if cfg is not None else _under(contract, config_for)(
            a, pw if base == "ours_prepared" else w) if base in ("ours", "ours_prepared") else "")
        rows.append(dict(kernel="gemm", provider=label, shape=name, M=m, N=n, K=k, median_ms=ms,
                         tflops=flops / ms / 1e9, gbps=nbytes / ms / 1e6, config=config, device=devname,
                         sha=sha))
        print(f"  {name:15s} M={m:6d} {label:28s} {ms:9.4f} ms {flops / ms / 1e9:8.1f} TFLOP/s", flush=True)


def _cfg_name(c):
    return f"{c['variant']}:{c['BM']}x{c['BN']}w{c['num_warps']}s{c['num_stages']}"


def _c(variant, bm, bn, warps, stages, group_m=8):
    return dict(BM=bm, BN=bn, GROUP_M=group_m, num_warps=warps, num_stages=stages, variant=variant)


# --sweep: alternatives timed beside the default at a few (shape, M) points; f16/w16/w16w rows use the
# prepared weight (its one-time decode is not timed). decode32 is absent: Triton 3.6 cannot build it.
PREPARED_VARIANTS = ("f16", "w16", "w16w")
SWEEPS = {
    ("square8192", 1): [_c("decode", 64, 64, 4, 4, 1), _c("small", 16, 64, 4, 4, 1), _c("small", 16, 32, 4, 4, 1)],
    ("square8192", 16): [_c("decode", 64, 64, 4, 4, 1)],
    ("square8192", 4096): [_c("f16", 128, 256, 8, 3)],
    ("k_proj", 4096): [_c("f16", 64, 128, 4, 4)],
    ("router", 4096): [_c("f16", 64, 128, 4, 4)],
}
# grouped (moe_gate_up, 16384 tokens): packed experts unless the variant pre-decodes them (f16/w16w: the
# prepared experts, decode not timed; "f16@call": packed experts, decoded on every call)
GROUPED_SWEEP = [dict(BM=128, BN=128, num_warps=8, num_stages=4, variant="f16"),
                 dict(BM=64, BN=256, num_warps=4, num_stages=4, variant="f16")]


def moe_offsets(tokens: int, experts: int, top_k: int, dev, align: int = 16) -> torch.Tensor:
    """Random top-k routing -> per-expert row counts rounded to a multiple of ``align`` (1: exact) ->
    offsets [E+1]."""
    g = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, experts, generator=g)
    counts = torch.bincount(logits.topk(top_k, dim=1).indices.flatten(), minlength=experts)
    if align > 1:
        counts = (counts + align // 2) // align * align
    return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(dev)


def bench_grouped(timer, name, n, k, tokens, dev, rows, sha, devname, sweep=False, kc=0):
    e, top_k = 128, 8
    offs = moe_offsets(tokens, e, top_k, dev, align=1 if tokens in DECODE_TOKENS else 16)
    m = int(offs[-1])
    a = quantize(torch.randn(m, k, device=dev), scaling="row")
    ws = stack_experts([quantize(torch.randn(n, k, device=dev)) for _ in range(e)])
    wsp = decode_layout(prepare_experts(ws))  # prepared: f16 for large M, fragment order for the decode kernel
    a16 = ref.dequantize(a).bfloat16()
    w16 = torch.randn(e, n, k, device=dev, dtype=torch.bfloat16)
    offs32 = offs[1:].to(torch.int32)
    flops = 2.0 * m * n * k
    used = int((offs[1:] > offs[:-1]).sum())  # experts with rows: the weights a provider must read
    per_set = {"grouped_mm_bf16": _nbytes(a16) + used * n * k * 2 + m * n * 2,
               "ours": _nbytes(a) + used * _nbytes(ws.codes[0], ws.scales[0]) + m * n * 2,
               "ours_prepared": _nbytes(a) + used * _nbytes(wsp.f16[0] if wsp.f16 is not None else wsp.codes[0])
               + m * n * 2}

    def mk(provider, cfg=None):
        provider, contract = _split_kc(provider)
        gemm = _under(contract, grouped_nvfp4_gemm)
        prep = provider == "ours_prepared" or (cfg is not None and cfg["variant"] in PREPARED_VARIANTS)
        n_rot = max(1, min(16, math.ceil(2 * L2_BYTES / per_set["ours_prepared" if prep else provider])))
        if provider == "grouped_mm_bf16":
            sets = list(zip(_copies(a16, n_rot), _copies(w16, n_rot)))
            return on_copy(sets, lambda x, w: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs32))
        if cfg is not None and cfg["variant"] == "f16@call":
            cfg = dict(cfg, variant="f16")
        sets = list(zip(_copies(a, n_rot), _copies(wsp if prep else ws, n_rot)))
        return on_copy(sets, lambda x, w: gemm(x, w, offs, config=cfg))

    cfgs = [(p, None) for p in _with_k_chunk(["grouped_mm_bf16", "ours", "ours_prepared"], kc)]
    if sweep and name == "moe_gate_up" and tokens == 16384:
        cfgs += [("ours", c) for c in GROUPED_SWEEP + [dict(GROUPED_F16_CONFIG, variant="f16@call")]]
    for provider, cfg in cfgs:
        label = provider if cfg is None else "ours:" + _cfg_name(dict(cfg, GROUP_M=1))
        base, contract = _split_kc(provider)
        nb = per_set[base]
        try:
            ms = timer(mk(provider, cfg), nb)
        except Exception as exc:
            print(f"  {label} {name}: FAILED {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            ms = float("nan")
        config = (_cfg_name(dict(cfg, GROUP_M=1)) if cfg is not None else _under(contract, grouped_config_for)(
            a, wsp if base == "ours_prepared" else ws) if base in ("ours", "ours_prepared") else "")
        provider = label
        rows.append(dict(kernel="grouped_gemm", provider=provider, shape=f"{name}_E{e}top{top_k}_T{tokens}",
                         M=m, N=n, K=k, median_ms=ms, tflops=flops / ms / 1e9,
                         gbps=nb / ms / 1e6, config=config, device=devname, sha=sha))
        print(f"  {name:15s} T={tokens:6d} M={m:6d} {provider:28s} {ms:9.4f} ms {flops / ms / 1e9:8.1f} TFLOP/s",
              flush=True)


def bench_quantize(timer, m, k, dev, rows, sha, devname):
    """Activation quantizer, row scaling, RNE, bf16 in (check=False on both: no host sync)."""
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    nbytes = m * k * 2 + m * k // 2 + m * k // 16 + m * 4
    for provider, fn in (("torch_reference", lambda t: ref.quantize(t, scaling="row", check=False)),
                         ("ours", lambda t: quantize(t, scaling="row", check=False))):
        n_rot = max(1, min(64, math.ceil(2 * L2_BYTES / nbytes)))
        xs = _copies(x, n_rot)
        try:
            ms = timer(on_copy([(x,) for x in xs], fn), nbytes)
        except Exception as exc:
            print(f"  quantize {provider}: FAILED {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            ms = float("nan")
        rows.append(dict(kernel="quantize", provider=provider, shape="activation_row_rne", M=m, N=0, K=k,
                         median_ms=ms, tflops=float("nan"), gbps=nbytes / ms / 1e6, device=devname, sha=sha))
        print(f"  quantize M={m} K={k} {provider:16s} {ms:9.4f} ms {nbytes / ms / 1e6:8.1f} GB/s", flush=True)


def _dry_timer(make, nbytes):
    make(0)()
    return float("nan")


def run(args, prov: dict, publish) -> int:
    """Check, then time; ``prov``: the provenance block (sha, device, command, date, ...) every row and the
    summary carry; ``publish(df, summary_markdown)`` is called after every group (a killed run leaves the
    complete groups)."""
    dry = getattr(args, "dry_run", False)
    if not torch.cuda.is_available() and not dry:
        print("kernel-bench needs a CUDA GPU (none visible); --dry-run runs the pipeline on CPU untimed",
              file=sys.stderr)
        return 2
    import pandas as pd

    from .gemm import config_status
    from .report import summary
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    kc = getattr(args, "k_chunk", 0) or 0
    if kc:
        with k_chunk_contract(kc):  # a bad width fails here, before anything runs
            pass
    check_lines = [] if (args.skip_checks or dry) else checks.run_all(dev) + decode_checks(dev, kc)
    timer = _dry_timer if dry else Timer(graph=not args.no_graph, rep=args.rep)
    rows: list[dict] = []
    kind = ("dry run: untimed" if dry else "CUDA-graph replays (triton.testing.do_bench_cudagraph)"
            if timer.graph else "triton.testing.do_bench")

    def flush():
        df = pd.DataFrame(rows)
        for key in ("command", "date"):
            df[key] = prov[key]
        md = summary(df, prov, check_lines, kind, config_status())
        publish(df, md)
        return md
    shapes, ms_list = (QUICK_SHAPES, QUICK_MS) if args.quick else (SHAPES, MS)
    grouped = GROUPED
    tokens_list = [1, 16, 16384] if args.quick else DECODE_TOKENS + [4096, 16384]
    qms = [4096, 16384]
    if dry:
        shapes, ms_list, grouped, tokens_list, qms = [("tiny", 48, 256)], [1, 17], [("moe_tiny", 32, 128)], [1, 64], [8]
    # order: MoE first, then the square shape, then the Qwen projections (a run cut short keeps the most)
    for tokens in tokens_list[::-1]:
        for name, n, k in grouped:
            bench_grouped(timer, name, n, k, tokens, dev, rows, prov["sha"], prov["device"], args.sweep, kc)
        flush()
    for name, n, k in sorted(shapes, key=lambda s: s[0] != "square8192"):
        for m in ms_list:
            bench_dense(timer, name, n, k, m, dev, rows, prov["sha"], prov["device"], args.sweep, kc)
        flush()
    qtimer = timer if dry else Timer(graph=False, rep=args.rep)  # the torch reference syncs: no graph
    for m in qms:
        bench_quantize(qtimer, m, 64 if dry else 2048, dev, rows, prov["sha"], prov["device"])
    print(flush())
    return 0


def decode_checks(device, kc: int = 0) -> list[str]:
    """Decode-regime batch invariance (GPU): rows at M = 1..64 (the decode kernel), from the plain codes and
    from the prepared weight's fragment-order codes, bitwise equal to the same rows inside M = 16384 (the
    large-M path), dense with a bias, under the default contract and, with ``kc``, under the K-chunk contract
    too; grouped at 1 and 8 tokens x top-8 over 128 experts bitwise equal to the grouped decode loop (the
    reference config)."""
    from .gemm import GROUPED_FALLBACK, config_status
    lines = []
    g = torch.Generator(device="cpu").manual_seed(11)
    n, k = 1536, 2048
    a = quantize(torch.randn(16384, k, generator=g).to(device), scaling="row")
    w = quantize(torch.randn(n, k, generator=g).to(device))
    bias = torch.randn(n, generator=g).to(device)
    pw = decode_layout(prepare_weight(w))  # fragment-order codes: the decode kernel's other weight form
    for contract, dt in itertools.product((None, kc) if kc else (None,), (torch.float32, torch.bfloat16)):
        gemm = _under(contract, nvfp4_gemm)
        full = gemm(a, w, out_dtype=dt, bias=bias)
        bad, bad_prepared = [], []
        for m in DECODE_MS:
            rows = ref.NVFP4Tensor(a.codes[7:7 + m], a.scales[7:7 + m], a.global_scale[7:7 + m])
            if not torch.equal(gemm(rows, w, out_dtype=dt, bias=bias), full[7:7 + m]):
                bad.append(m)
            if not torch.equal(gemm(rows, pw, out_dtype=dt, bias=bias), full[7:7 + m]):
                bad_prepared.append(m)
        under = f", K chunks of {contract}" if contract else ""
        lines.append(f"- {'FAIL' if bad else 'PASS'} decode batch invariance M in {DECODE_MS} vs M=16384, "
                     f"{str(dt)[6:]} + bias{under}: {'differ at M=' + str(bad) if bad else 'bitwise equal'}")
        lines.append(f"- {'FAIL' if bad_prepared else 'PASS'} decode rows of the prepared weight (fragment "
                     f"order) M in {DECODE_MS} vs M=16384, {str(dt)[6:]} + bias{under}: "
                     f"{'differ at M=' + str(bad_prepared) if bad_prepared else 'bitwise equal'}")
    e, top_k = 128, 8
    ws = stack_experts([quantize(torch.randn(256, k, generator=g).to(device)) for _ in range(e)])
    for tokens in (1, 8):
        offs = moe_offsets(tokens, e, top_k, device, align=1)
        m = int(offs[-1])
        x = quantize(torch.randn(m, k, generator=g).to(device), scaling="row")
        out = grouped_nvfp4_gemm(x, ws, offs, out_dtype=torch.float32)
        same = torch.equal(out, grouped_nvfp4_gemm(x, ws, offs, out_dtype=torch.float32, config=GROUPED_FALLBACK))
        lines.append(f"- {'PASS' if same else 'FAIL'} grouped decode {tokens} token(s) x top-{top_k}, {e} experts: "
                     f"{'bitwise equal' if same else 'differs from'} the grouped decode loop")
    lines.append("- configs probed: " + ", ".join(f"`{c}` {v}" for c, v in config_status().items()))
    for line in lines:
        print(line, flush=True)
    return lines
