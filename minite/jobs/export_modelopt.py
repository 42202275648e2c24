"""``python -m minite export-modelopt``: write the ModelOpt-NVFP4 checkpoint an arm's sampler serves.

Builds the policy (local checkpoint or seeded random init), ships it to the arm's sampler through the sync
API (the trainer's ``export_weights`` when the trainer engine is importable, else the same payload built from
the HF model), calibrates static activation scales on a few prompts (char models: seeded arithmetic
prompts; HF-tokenizer models: seeded random token ids), and writes the directory vLLM loads
(``minite.engines.modelopt_export``). Nothing is left half-written on error.
"""
from __future__ import annotations

import random
import sys

import torch


def add_args(p) -> None:
    p.add_argument("--arm", default="naive_te_nvfp4", help="an arm with an NVFP4 sampler (naive_te_nvfp4 = what "
                   "ModelOpt writes from BF16 weights; minite_nvfp4 = the trainer's codes)")
    p.add_argument("--model", default="tiny", help="tiny | small | qwen3_30b_a3b (or a model YAML)")
    p.add_argument("--checkpoint", default=None, help="local HF checkpoint dir (default: random init)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (full-width depth slice)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--calib-prompts", type=int, default=32, help="calibration prompts")
    p.add_argument("--seed", type=int, default=0)


def calibration_prompts(model_cfg: dict, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    if model_cfg.get("tokenizer") == "char":
        from minite.tokenizer import CharTokenizer

        tok = CharTokenizer()
        return [tok.encode(f"{rng.randint(0, 999)}{rng.choice('+-*')}{rng.randint(0, 999)}=") for _ in range(n)]
    v = int(model_cfg["vocab_size"])
    return [[rng.randrange(v) for _ in range(rng.randint(8, 64))] for _ in range(n)]


def _payload(arm, model_cfg, checkpoint, seed):
    try:
        from minite.engines.trainer import Trainer
    except ImportError:
        Trainer = None
    if Trainer is not None:
        return Trainer(arm, model_cfg, device="cpu", seed=seed, checkpoint=checkpoint).export_weights()
    from minite.engines.models import build_hf_config, build_hf_model
    from minite.engines.sync import payload_from_hf_model

    model = build_hf_model(model_cfg, build_hf_config(model_cfg), seed=seed, checkpoint=checkpoint)
    return payload_from_hf_model(model, arm)


def run(args) -> int:
    from minite.engines.arms import load_arm
    from minite.engines.modelopt_export import export_modelopt
    from minite.engines.models import load_model_config
    from minite.engines.sampler import Sampler

    arm = load_arm(args.arm)
    if not arm.sampler.is_nvfp4:
        print(f"export-modelopt: arm {arm.name} has a BF16 sampler; choose an NVFP4 arm "
              "(naive_te_nvfp4 or minite_nvfp4)", file=sys.stderr)
        return 2
    cfg = load_model_config(args.model, args.layers)
    torch.manual_seed(args.seed)
    sampler = Sampler(arm, cfg, device="cpu")
    sampler.load_weights(_payload(arm, cfg, args.checkpoint, args.seed))
    sampler.calibrate(calibration_prompts(cfg, args.calib_prompts, args.seed))
    out = export_modelopt(sampler, cfg, args.out, arm=arm)
    print(f"wrote ModelOpt NVFP4 checkpoint to {out}")
    return 0
