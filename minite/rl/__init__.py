"""minite.rl: long-horizon GRPO between the two engines of an arm, and what it needs.

    task.py        verifiable synthetic task (multi-digit arithmetic, exact answers, deterministic split)
    math_task.py   real-scale math task from a local jsonl/parquet (datasets + math-verify, optional extra)
    grpo.py        group-normalised advantages, clipped-ratio loss (clip-higher, k3 KL, optional TIS)
    sft.py         cached SFT warm start (bf16 trainer) shared by every arm
    stability.py   the RL loop: generate -> reward -> trainer recompute -> update -> sync; JSONL per step,
                   checkpoints, resume with the same curve
    drift.py       drift alarm (CUSUM on log k3) and reward-collapse detector
    evaluate.py    held-out mean@k per checkpoint with the sampler engine
    config.py      configs/rl/<profile>.yaml (cpu | h200 | b300)
    common.py      engines from the warm start, rollouts;  cli_args.py  flags shared by the jobs

Jobs (``python -m minite ...``):
    sft  --model tiny --rl-config cpu --out results/cpu/sft
    rl   --arm A --model tiny --rl-config cpu --steps N --ckpt-every K --init results/cpu/sft --out results/cpu/A
    eval --arm A --model tiny --rl-config cpu --run results/cpu/A --out results/cpu/A/evals.csv
"""
