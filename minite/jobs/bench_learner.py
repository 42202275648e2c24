"""``python -m minite bench-learner``: learner throughput, tokens/s of complete learner updates.

One step = one ``Trainer.update`` (forward, backward, AdamW step over all micro-batches) on random tokens.
tokens_per_s = tokens per update / median step time over the ``--steps`` timed steps after warm-up; the
JSON also holds every step's time and their spread (``step_ms_stats``: n, median, interquartile range,
min, max; ``minite.telemetry.timing_summary``), so a reader can tell a measurement from machine noise.
Writes one JSON (atomically; nothing on a bad arm/model) with the step split, peak memory, GPU telemetry
and provenance (sha, device, command, date, torch / triton versions, GPU driver).

The step split (quantize / gemm / other / optimizer) comes from ``--split-steps`` further updates that time
each of the ~1,400 quantize and GEMM blocks of an update (CUDA events on the GPU); the timed updates run
without that: the events' own host cost would otherwise be part of the measured step (it was most of the
miniTE update's run-to-run spread while that update was bound by its host, docs/KERNELS_NOTES.md).

Under torchrun (``--nproc-per-node N``) the update's sequences are split over the N ranks (the FSDP2 learner,
``minite.engines.fsdp``): tokens per update stay the global batch, so tokens_per_s compares with one GPU;
``peak_mem_gb`` is the largest of the ranks (``peak_mem_gb_per_rank`` lists them) and rank 0 writes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from tqdm import tqdm

from minite import distributed as D
from minite.jobs import common
from minite.jobs.profiling import write_torch_profile

DISTRIBUTED = True      # runs under torchrun: one process per GPU

# per model: (sequences per update, sequence length, layers (None = all), micro-batch size in sequences)
DEFAULTS = {"tiny": (4, 64, None, None), "small": (16, 512, None, 8), "qwen3_30b_a3b": (16, 2048, 2, 2)}
NOTES = {
    "naive_te_nvfp4": "On Hopper the naive arm's FP4 GEMMs run as TE's structure emulated: weights re-quantized "
                      "from BF16 (16x16), activations and gradients quantized with per-tensor amax, each cast a "
                      "fused minite.kernels pass that writes the dequantized BF16 values, then BF16 GEMMs; TE "
                      "itself would use FP4 tensor cores only on Blackwell. With micro-batching te.Linear "
                      "without is_first_microbatch re-quantizes per micro-batch: --weight-cache per_update "
                      "gives the fairer bound (see weight_cache / weight_quantizations_per_update).",
    "minite_nvfp4": "Weights quantized once per update; every W4A4 GEMM, forward and backward (dgrad on W^T "
                    "from the 16x16 tiles, wgrad on token-quantized operands, experts grouped), through "
                    "minite.kernels on the NVFP4 codes (Triton on Hopper: codes decoded to exact fp16 values, "
                    "fp16 tensor cores, fp32 accumulation in a fixed order; no FP4 tensor cores).",
    "bf16": "BF16 reference: HF modules, torch grouped_mm experts.",
}
NOTES["naive_te_nvfp4_tis"] = NOTES["naive_te_nvfp4_blanket"] = NOTES["naive_te_nvfp4"]   # the same learner


def add_args(p) -> None:
    p.add_argument("--arm", required=True, help="bf16 | naive_te_nvfp4 | minite_nvfp4 (or an arm YAML)")
    p.add_argument("--model", default="tiny", help="tiny | small | qwen3_30b_a3b (or a model YAML)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (full-width depth slice)")
    p.add_argument("--tokens-per-update", type=int, default=None, help="tokens per learner update")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length")
    p.add_argument("--micro-batch-size", type=int, default=None, help="sequences per micro-batch")
    p.add_argument("--steps", type=int, default=20,
                   help="timed updates after warm-up (their median is the result, their spread is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed updates first")
    p.add_argument("--split-steps", type=int, default=2,
                   help="updates after the timed ones with the quantize / gemm blocks timed (step_split_ms); "
                        "the timed updates run without that instrumentation")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--checkpoint", default=None, help="local HF checkpoint dir (default: random init)")
    p.add_argument("--weight-cache", choices=("per_update", "per_forward"), default=None,
                   help="NVFP4 weight quantization: once per update or every forward (default: the arm's — "
                        "per_update for minite, per_forward for naive, as te.Linear without is_first_microbatch)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder layer's forward in backward (less activation memory)")
    p.add_argument("--seed", type=int, default=0)
    common.add_torch_profile(p, "update (its minite.quantize.{weight,act,grad} / minite.gemm ranges too)")
    p.add_argument("--profile", dest="torch_profile", default=None, help=argparse.SUPPRESS)  # the old name
    common.add_out(p, "file", help="output JSON path")


def _fail(msg: str) -> int:
    print(f"bench-learner: error: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:
    from minite.engines.arms import ArmError, load_arm
    from minite.engines.models import ModelConfigError, check_positions, load_model_config
    from minite.provenance import provenance, repo_relative, write_json
    from minite.telemetry import SPREAD_LIMIT, GPUTelemetry, timing_summary

    try:
        arm = load_arm(args.arm)
        base = load_model_config(args.model)
        seqs, seq_len, layers, mbs = DEFAULTS.get(base["name"], (8, 256, None, None))
        layers = args.layers if args.layers is not None else layers
        cfg = load_model_config(args.model, num_layers=layers)
    except (ArmError, ModelConfigError) as e:
        return _fail(str(e))
    # only an absent flag takes the model's default: 0 or a negative size is an error (a micro-batch size of
    # -1 made an empty micro-batch loop, and a benchmark of updates that ran no forward or backward)
    for flag, v, least in (("--tokens-per-update", args.tokens_per_update, 1), ("--seq-len", args.seq_len, 2),
                           ("--micro-batch-size", args.micro_batch_size, 1)):
        if v is not None and v < least:
            return _fail(f"{flag} must be >= {least}, got {v}")
    seq_len = args.seq_len if args.seq_len is not None else seq_len
    tokens = args.tokens_per_update if args.tokens_per_update is not None else seqs * seq_len
    mbs = args.micro_batch_size if args.micro_batch_size is not None else mbs
    if tokens % seq_len:
        return _fail(f"--tokens-per-update {tokens} must be a positive multiple of --seq-len {seq_len}")
    if args.steps < 1 or args.warmup < 0 or args.split_steps < 0:
        return _fail("--steps must be >= 1, --warmup and --split-steps >= 0")
    try:
        check_positions(cfg, seq_len, "--seq-len")
        device = common.device_of(args)
    except ValueError as e:
        return _fail(str(e))
    n_seq = tokens // seq_len
    try:
        rows = D.row_share(n_seq, "sequences per update")
    except ValueError as e:
        return _fail(str(e))

    from minite.engines.trainer import Trainer

    try:
        trainer = Trainer(arm, cfg, device=device, seed=args.seed, micro_batch_size=mbs,
                          checkpoint=args.checkpoint, weight_cache=args.weight_cache,
                          activation_checkpointing=args.activation_checkpointing)
    except (ValueError, ModelConfigError) as e:
        return _fail(str(e))
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(3, cfg["vocab_size"], (n_seq, seq_len), generator=g)
    ids = ids[rows]                          # this rank's sequences (all of them in one process)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    results, split_results = [], []
    tel = GPUTelemetry(device)
    n_timed = args.warmup + args.steps
    for i in tqdm(range(n_timed + args.split_steps), desc=f"bench-learner {arm.name}", unit="update",
                  disable=not D.is_main()):
        if i == args.warmup:
            tel.start()
        if i == n_timed:
            tel.stop()
        trainer.qstate.split_timing = i >= n_timed   # the timed updates carry no split instrumentation
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = trainer.update(batch)
        if cuda:
            torch.cuda.synchronize()
        r["wall_s"] = time.perf_counter() - t0
        if i >= n_timed:
            split_results.append(r)
        elif i >= args.warmup:
            results.append(r)
    if not split_results:
        tel.stop()
    trainer.qstate.split_timing = True
    step_s = [r["wall_s"] for r in results]
    stats = timing_summary([t * 1e3 for t in step_s])
    med = statistics.median(step_s)

    def split(key):
        vals = [r["times"][key] for r in split_results if r["times"][key] is not None]
        return statistics.median(vals) * 1e3 if vals else None

    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2 ** 30
        mem_note = "torch.cuda.max_memory_allocated"
    else:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB -> GiB (Linux)
        mem_note = "peak process RSS (CPU run)"
    peaks = D.all_gather_object(peak)
    peak = max(peaks)
    n_params = sum(p.numel() for p in trainer.params)
    out = {
        "tokens_per_s": tokens / med, "step_ms": med * 1e3, "step_ms_all": [s * 1e3 for s in step_s],
        "step_ms_stats": stats,
        "step_split_ms": {k: split(k) for k in ("quantize", "gemm", "other", "optimizer")},
        "step_split_steps": len(split_results),
        "step_split_step_ms": (statistics.median(r["wall_s"] for r in split_results) * 1e3
                               if split_results else None),
        "step_split_note": "medians over the --split-steps updates after the timed ones, which time every "
                           "quantize / GEMM block (their update time is step_split_step_ms: the blocks' own "
                           "host cost is not in step_ms); CUDA events on GPU, host clock on CPU. quantize = NVFP4 "
                           "weight/activation/gradient quantization inside minite's modules; gemm = their "
                           "NVFP4 GEMMs, forward and backward (the kernel path's fp16 decode passes and the "
                           "emulated path's dequantize included); "
                           "null for BF16, whose GEMMs run inside HF modules; other = the rest of forward/"
                           "backward (attention, norms, BF16 GEMMs, fp32 grad accumulation); optimizer = "
                           "grad-norm clip + AdamW + master->BF16 copy",
        "weight_quantizations_per_update": (results[-1]["weight_quantizations"]
                                            - results[-2]["weight_quantizations"]) if len(results) > 1 else None,
        "peak_mem_gb": peak, "peak_mem_source": mem_note,
        **({"peak_mem_gb_per_rank": peaks, "world_size": len(peaks)} if len(peaks) > 1 else {}),
        "activation_checkpointing": args.activation_checkpointing,
        "telemetry": tel.summary(tokens=tokens * len(results)),
        "arm": arm.name, "model": cfg["name"], "layers": cfg["num_hidden_layers"], "params": n_params,
        "tokens_per_update": tokens, "seq_len": seq_len, "micro_batch_size": mbs or n_seq,
        "steps": args.steps, "warmup": args.warmup, "trainer_gemm": arm.trainer.gemm,
        "weight_cache": "per_update" if trainer.qstate.cache_per_update else "per_forward",
        "losses": [r["loss"] for r in results], "note": NOTES.get(arm.name, ""),
        "input": "random tokens",
    }
    out.update(provenance(device=device))
    if args.torch_profile:
        out["torch_profile"] = repo_relative(args.torch_profile)
        out["torch_profile_update"] = write_torch_profile(
            args.torch_profile, lambda: trainer.update(batch), cuda,
            {"arm": arm.name, "sha": out["sha"], "device": out["device"]}, write=D.is_main())
    if not D.is_main():
        return 0
    write_json(args.out, out)
    print(f"{arm.name} {cfg['name']} x{cfg['num_hidden_layers']} layers on {out['device']}: "
          f"{out['tokens_per_s']:.1f} tokens/s, {out['step_ms']:.1f} ms/update (median of {stats['n']}; "
          f"interquartile range {stats['q25']:.1f}-{stats['q75']:.1f} ms) -> {args.out}")
    if stats["spread"] > SPREAD_LIMIT:
        print(f"bench-learner: warning: the step times spread by {100 * stats['spread']:.0f}% of their median "
              f"(interquartile range; limit {100 * SPREAD_LIMIT:.0f}%): the machine was busy, ratios against this "
              "run are unreliable", file=sys.stderr)
    return 0
