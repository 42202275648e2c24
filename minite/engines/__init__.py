"""minite.engines: the two engines of an arm and what they share (see module docstrings, docs/ENGINES.md).

    arms.py          load_arm -> Arm (trainer / sampler recipes)
    models.py        model configs -> transformers Qwen3MoeConfig / Qwen3MoeForCausalLM
    trainer.py       Trainer: HF model + NVFP4 modules (quant_linear.py, experts.py), AdamW, logprobs, sync export
    sampler.py       Sampler: the vLLM-like engine (sampler_ops.py: its ops; sampler_weights.py: its fused weights)
    sync.py          the weight payload trainer -> sampler: sync_weights(trainer, sampler)
    gemm.py / attention.py   the NVFP4 linear forward and batch-invariant attention both engines use
    names.py         transformers parameter name -> module kind and layer (what each engine quantizes)
"""


def build_engines(arm, model, device="cpu", seed: int = 0, checkpoint=None, calibration_prompts=None,
                  max_batch: int = 64, max_seq_len=None, **trainer_kwargs):
    """(trainer, sampler) for one arm and model, weights synced, the sampler calibrated when its
    activations use static scales. ``calibration_prompts``: token-id lists for that calibration (the task's
    prompts); without them, 8 seeded random prompts of 16 tokens stand in (fine for smoke tests only)."""
    import torch

    from minite.engines.arms import load_arm
    from minite.engines.models import load_model_config
    from minite.engines.sampler import Sampler
    from minite.engines.sync import sync_weights
    from minite.engines.trainer import Trainer

    arm = load_arm(arm) if isinstance(arm, str) else arm
    model_cfg = load_model_config(model)
    trainer = Trainer(arm, model_cfg, device=device, seed=seed, checkpoint=checkpoint, **trainer_kwargs)
    sampler = Sampler(arm, model_cfg, device=device, max_batch=max_batch, max_seq_len=max_seq_len)
    sync_weights(trainer, sampler)
    if arm.needs_calibration:
        if calibration_prompts is None:
            g = torch.Generator().manual_seed(seed)
            hi = min(model_cfg["vocab_size"], 32)
            calibration_prompts = [[1] + torch.randint(3, hi, (15,), generator=g).tolist() for _ in range(8)]
        sampler.calibrate(calibration_prompts)
    return trainer, sampler
