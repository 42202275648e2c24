"""``python -m minite bench-sampler``: rollout throughput, decode tokens/s of the sampler against the bandwidth
roofline of the weights each decode step reads.

One timed ``Sampler.generate`` of ``--batch`` random prompts of ``--prompt-len`` tokens for ``--new-tokens``
tokens (no stop token: every sequence decodes every step), after one untimed run that captures the CUDA graphs
and compiles the kernels. Per decode step: CUDA events on the GPU (host clock on CPU) between the step
boundaries ``Sampler.on_step`` marks; nothing is synchronised inside the run.

Weight bytes per decode step = what the step must read: the embedding rows of the batch, every norm, the
attention and router weights, the lm_head, and per layer the experts its routing touches (distinct experts
chosen by the batch's rows at that step, counted from the routing of a replay of the generated tokens),
each in the form the arm's GEMM reads (BF16; NVFP4 codes + E4M3 block scales + fp32 global scales for the
kernel path, or its fp16 copy at the batch sizes where the kernels read that, ``kernels.dense_weight_bytes``;
the cached BF16 dequantization for the emulated path). The KV cache is not a weight and is
reported apart. Roofline: tokens/s if every step only read those bytes at the copy bandwidth measured in the
same run (``telemetry.copy_bandwidth``: the median of repeated timings of back-to-back 1 GiB device copies,
read + write bytes over their time; its range is recorded beside it); roofline_frac = measured / roofline.
Writes one JSON atomically, with provenance. ``--torch-profile CSV``: one more generate (the same prompts,
CUDA graphs as timed) under torch.profiler, its kernels and ops in a CSV (``minite.jobs.profiling``), and on
the GPU one decode step's kernels in launch order with their own times in ``<CSV stem>.steps.csv``.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections import Counter
from itertools import pairwise

import torch

from minite import kernels
from minite.jobs import common
from minite.telemetry import copy_bandwidth

log = logging.getLogger(__name__)

NOTE = ("Random-init weights (seeded) unless --checkpoint: throughput does not depend on the values, but the "
        "routing of a random-init model is close to uniform, so the experts touched per step (and the bytes "
        "read) are those of a near-uniform router.")


def add_args(p) -> None:
    common.add_arm(p)
    common.add_model(p)
    p.add_argument("--batch", type=int, default=8, help="sequences generated together")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per (random) prompt")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence")
    p.add_argument("--eager", action="store_true", help="run the decode steps without CUDA graphs")
    common.add_torch_profile(p, "generate (the same prompts; CUDA graphs as timed)")
    common.add_device(p)
    common.add_seed(p)
    common.add_checkpoint(p, help="local HF checkpoint dir or SFT directory (default: a seeded random init)")
    common.add_out(p, "file", help="output JSON path")


def run(args) -> int:
    from minite.engines.arms import load_arm
    from minite.engines.models import check_positions
    from minite.provenance import repo_relative, write_json
    from minite.rl.spec import warm_start_weights
    from minite.telemetry import SPREAD_LIMIT, timing_summary

    arm, cfg = load_arm(args.arm), common.model_of(args)
    if args.batch < 1 or args.prompt_len < 1 or args.new_tokens < 2:
        raise ValueError("--batch and --prompt-len must be >= 1 and --new-tokens >= 2 (one decode step at least)")
    check_positions(cfg, args.prompt_len + args.new_tokens,
                    f"--prompt-len ({args.prompt_len}) + --new-tokens ({args.new_tokens})")
    device = common.device_of(args)
    ckpt = warm_start_weights(args.checkpoint)  # an SFT directory -> its weights, as rl and diagnose take it
    sampler = build_sampler(arm, cfg, device, args.seed, ckpt, args.batch,
                            args.prompt_len + args.new_tokens, cuda_graphs=not args.eager)
    out = measure(sampler, args.batch, args.prompt_len, args.new_tokens, args.seed)
    out["weights"] = f"checkpoint {args.checkpoint}" if args.checkpoint else f"random init (seed {args.seed})"
    if args.torch_profile:
        out["torch_profile"] = repo_relative(args.torch_profile)
        out["torch_profile_generate"] = profile_generate(
            sampler, args.batch, args.prompt_len, args.new_tokens, args.seed, args.torch_profile,
            {"arm": arm.name, "sha": out["sha"], "device": out["device"]})
    write_json(args.out, out)
    log.info("%s %s x%d layers, batch %d on %s (%s): %.0f tokens/s, %.3f ms/step, %.1f%% of roofline -> %s",
             arm.name, cfg["name"], cfg["num_hidden_layers"], args.batch, out["device"],
             "graphs" if out["cuda_graphs"] else "eager", out["decode_tokens_per_s"], out["step_ms"]["median"],
             100 * out["roofline_frac"], args.out)
    spread = timing_summary(out["step_ms_all"])["spread"]
    if spread > SPREAD_LIMIT:
        log.warning("bench-sampler: the decode steps spread by %.0f%% of their median (interquartile range; limit "
                    "%.0f%%): the machine was busy, ratios against this run are unreliable", 100 * spread,
                    100 * SPREAD_LIMIT)
    return 0


# ------------------------------------------------------------------------------------------------- parts
def build_sampler(arm, cfg: dict, device, seed: int, checkpoint, max_batch: int, max_seq_len: int,
                  cuda_graphs: bool = True):
    """A sampler holding the weights the trainer of ``arm`` would ship from a (random-init or checkpoint)
    model, calibrated when its activations use static scales."""
    from minite.engines.models import build_hf_config, build_hf_model
    from minite.engines.sampler import Sampler
    from minite.engines.sync import payload_from_hf_model

    model = build_hf_model(cfg, build_hf_config(cfg), seed=seed, checkpoint=checkpoint, device=device)
    payload = payload_from_hf_model(model, arm)
    del model
    sampler = Sampler(arm, cfg, device=device, max_batch=max_batch, max_seq_len=max_seq_len,
                      cuda_graphs=cuda_graphs)
    sampler.load_weights(payload)
    del payload
    acts = arm.sampler.activations
    if acts is not None and acts.scaling == "static":
        sampler.calibrate(random_prompts(8, min(16, max_seq_len), cfg["vocab_size"], seed + 1))
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return sampler


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, length), generator=g)
    ids[:, 0] = 1  # BOS
    return ids.tolist()


class StepTimer:
    """``Sampler.on_step`` marks: CUDA events on the GPU (read after the run), the host clock on CPU."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def __call__(self, label: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((label, ev))
        else:
            self.marks.append((label, time.perf_counter()))

    def intervals_ms(self) -> list[tuple[str, float]]:
        """(label of the later mark, ms since the previous mark)."""
        if self.cuda:
            torch.cuda.synchronize()
        return [(b[0], a[1].elapsed_time(b[1]) if self.cuda else (b[1] - a[1]) * 1e3)
                for a, b in pairwise(self.marks)]


def _lin_bytes(lin, batch: int, tokens_f16: bool = False) -> int:
    """``tokens_f16``: the linear's tokens come with their fp16 form (the norm-cast before it wrote it)."""
    if not lin.quantized:
        return lin.weight.numel() * lin.weight.element_size()
    if lin.deq is not None:  # the emulated GEMM reads the cached BF16 dequantization
        return lin.deq.numel() * lin.deq.element_size()
    return kernels.dense_weight_bytes(lin.decode if lin.decode is not None else lin.q, batch, tokens_f16)


def _expert_bytes(ex) -> int:
    """Bytes of one expert (gate/up + down) in the form the arm's grouped GEMM reads."""
    if not ex.quantized:
        return (ex.gate_up[0].numel() + ex.down[0].numel()) * ex.gate_up.element_size()
    deq = ex.__dict__.get("_deq", {})
    if deq:
        return sum(deq[p][0].numel() * deq[p].element_size() for p in ("gate_up", "down"))
    return sum(t[0].numel() * t.element_size() for p in ("gate_up", "down")
               for t in (ex.stacked[p].codes, ex.stacked[p].scales, ex.stacked[p].global_scale))


def weight_bytes(sampler, batch: int, touched: list[float]) -> dict:
    """Bytes of weights one decode step of ``batch`` rows reads (module docstring); ``touched``: mean distinct
    experts per layer per step."""
    from minite.engines.sampler_ops import norm_codes_reused

    w = sampler.weights
    split = Counter()
    split["embed_rows"] = batch * w.embed.shape[1] * w.embed.element_size()
    split["lm_head"] = _lin_bytes(w.lm_head, batch)
    split["norms"] = w.norm.numel() * w.norm.element_size()
    codes_reused = norm_codes_reused(sampler.recipe, None)
    for li, lw in enumerate(w.layers):
        split["norms"] += sum(t.numel() * t.element_size() for t in (lw.input_norm, lw.post_norm, lw.q_norm,
                                                                       lw.k_norm))
        # q/k/v read the fp16 form the input norm's cast writes where its codes are reused (``rms_norm_for_linears``)
        split["attention"] += _lin_bytes(lw.qkv, batch, codes_reused) + _lin_bytes(lw.o, batch)
        if lw.experts is None:
            split["dense_mlp"] += _lin_bytes(lw.gate_up, batch) + _lin_bytes(lw.down, batch)
        else:
            split["router"] += _lin_bytes(lw.router, batch)
            split["experts"] += touched[li] * _expert_bytes(lw.experts)
    return {"total": float(sum(split.values())), "split": {k: float(v) for k, v in split.items()}}


def experts_touched(sampler, out) -> list[float]:
    """Mean distinct experts per layer per decode step: a replay of the generated tokens through the decode
    step (``score`` with a capture hook) reading each step's routing."""
    seen: dict[int, list[int]] = {}

    def hook(layer, op, pos, t):
        if op == "topk":
            seen.setdefault(layer, []).append(int(torch.unique(t[:, -1]).numel()))
    sampler.score(out.tokens, out.prompt_lens, capture=hook)
    return [statistics.mean(v[1:]) if len(v) > 1 else 0.0 for _, v in sorted(seen.items())]  # [0]: prefill


def count_step_ops(sampler, batch: int, pos: int) -> dict:
    """PyTorch ops one eager decode step dispatches (views and allocations left out): in all, per decoder
    layer (from one layer's attention to the next's: its attention, MoE and the two norms that follow) and
    outside the layers (embedding, first norm, final norm, lm_head, sampling). On the GPU each is about one
    kernel launch; Triton kernels (NVFP4 GEMMs, the fused quantizer) launch outside the dispatcher and are
    not counted. On CPU the NVFP4 kernel path is PyTorch loops over experts (more ops, data-dependent)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        skip = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh"})

        def __init__(self):
            super().__init__()
            self.n, self.names = 0, Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not func.is_view and name not in self.skip:
                self.n += 1
                self.names[name] += 1
            return func(*args, **(kwargs or {}))

    _, runner = sampler._decode_ready()
    n = min(batch, sampler.max_batch)
    runner.start(list(range(n)), torch.full((n,), 3, device=sampler.device),
                 torch.full((n,), pos, device=sampler.device))
    counter, marks = Ops(), []

    def marking(fn):
        def wrapped(*a, **k):
            marks.append(counter.n)
            return fn(*a, **k)
        return wrapped
    sampler._attention, sampler._logits = marking(sampler._attention), marking(sampler._logits)
    try:
        with counter:
            sampler._decode_step(runner.size, "sample")
    finally:
        del sampler._attention, sampler._logits  # the class's methods again
    per_layer = [b - a for a, b in pairwise(marks)]
    return {"per_step": counter.n, "per_layer": per_layer, "outside_layers": counter.n - sum(per_layer),
            "top_ops": dict(counter.names.most_common(12))}


def profile_generate(sampler, batch: int, prompt_len: int, new_tokens: int, seed: int, path, meta: dict) -> dict:
    """One more generate of ``measure``'s prompts under torch.profiler -> ``path`` (CSV; on the GPU also one
    decode step's kernels, ``profiling.steps_path``); the summary, with the number of decode steps it ran (the
    kernels and times in the CSV are for the whole generate)."""
    from minite.jobs.profiling import write_torch_profile

    prompts = random_prompts(batch, prompt_len, sampler.config.vocab_size, seed)
    gen = torch.Generator(device=sampler.device).manual_seed(seed)
    cuda = sampler.device.type == "cuda"
    marker = None
    if cuda:  # every decode step starts with kernels.step_inputs: where the per-step table cuts
        from minite.kernels._triton_sampling import _step_inputs_kernel
        marker = _step_inputs_kernel.fn.__name__
    summary = write_torch_profile(
        path, lambda: sampler.generate(prompts, new_tokens, generator=gen, stop_token=None), cuda, meta,
        step_marker=marker)
    return {**summary, "decode_steps": new_tokens - 1}


# ------------------------------------------------------------------------------------------------- measure
def measure(sampler, batch: int, prompt_len: int, new_tokens: int, seed: int = 0, touched=None) -> dict:
    """One benchmark point on a built sampler (module docstring). Returns the JSON record. ``touched``: the
    experts touched per layer, when known from an earlier point with the same prompts (else replayed)."""
    from minite.provenance import provenance

    cuda = sampler.device.type == "cuda"
    prompts = random_prompts(batch, prompt_len, sampler.config.vocab_size, seed)
    gen = torch.Generator(device=sampler.device).manual_seed(seed)
    t0 = time.perf_counter()
    sampler.generate(prompts, new_tokens, generator=gen, stop_token=None)  # capture graphs, compile kernels
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    first_s = time.perf_counter() - t0
    timer = StepTimer(cuda)
    sampler.on_step = timer
    t0 = time.perf_counter()
    try:
        out = sampler.generate(prompts, new_tokens, generator=gen, stop_token=None)
    finally:
        sampler.on_step = None
    if cuda:
        torch.cuda.synchronize()
    generate_s = time.perf_counter() - t0
    marks = timer.intervals_ms()
    prefill_ms = next(ms for label, ms in marks if label == "prefill")
    steps = [ms for label, ms in marks if label == "step"]
    decode_s = sum(steps) / 1e3
    if cuda:
        peak, mem_source = torch.cuda.max_memory_allocated() / 2 ** 30, "torch.cuda.max_memory_allocated"
    else:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB -> GiB (Linux)
        mem_source = "peak process RSS (CPU run)"
    touched = experts_touched(sampler, out) if touched is None else touched
    wb = weight_bytes(sampler, batch, touched)
    bw_gbs = copy_bandwidth(sampler.device)
    bw = bw_gbs["median"] * 1e9
    tok_s = batch * len(steps) / decode_s
    roof_step_s = wb["total"] / bw
    c = sampler.config
    kv_token = 2 * c.num_hidden_layers * sampler.n_kv * sampler.head_dim * 2  # K and V, BF16, per position
    q = statistics.quantiles(steps, n=10) if len(steps) > 1 else [steps[0]] * 9
    rec = sampler.recipe
    res = {
        "decode_tokens_per_s": tok_s,
        "step_ms": {"median": statistics.median(steps), "p10": q[0], "p90": q[-1], "min": min(steps),
                    "max": max(steps), "mean": statistics.mean(steps), "n": len(steps)},
        "step_ms_all": steps, "prefill_ms": prefill_ms, "generate_s": generate_s,
        "generate_tokens_per_s": batch * new_tokens / generate_s, "first_generate_s": first_s,
        "weight_bytes_per_step": wb["total"], "weight_bytes_split": wb["split"],
        "experts_touched_per_step": touched,
        "kv_bytes_per_step_mean": batch * kv_token * (prompt_len + new_tokens / 2),
        "copy_bandwidth_gbs": bw / 1e9, "copy_bandwidth_range_gbs": [bw_gbs["min"], bw_gbs["max"]],
        "roofline_step_ms": roof_step_s * 1e3,
        "roofline_tokens_per_s": batch / roof_step_s, "roofline_frac": tok_s / (batch / roof_step_s),
        "peak_mem_gb": peak, "peak_mem_source": mem_source,
        "ops_per_decode_step": count_step_ops(sampler, batch, prompt_len),
        "arm": sampler.arm.name, "model": sampler.model_cfg.get("name"), "layers": c.num_hidden_layers,
        "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "cuda_graphs": bool(sampler._runner.cuda_graphs), "max_batch": sampler.max_batch,
        "max_seq_len": sampler.max_seq_len, "sampler_gemm": rec.gemm, "attention": rec.attention,
        "non_gemm": rec.non_gemm, "hp_gemm": rec.hp_gemm,
        "weight_bytes_note": "per decode step: embedding rows, norms, attention, router, lm_head, and the experts "
                             "each layer's routing touches (mean distinct experts over the steps of a replay of "
                             "the generated tokens), in the form the arm's GEMMs read; the KV cache apart",
        "note": NOTE,
    }
    res.update(provenance(device=sampler.device))
    return res
