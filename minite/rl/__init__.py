"""minite.rl: long-horizon GRPO between the two engines of an arm, and what it needs.

    spec.py         RunSpec (arm, model, RL config, task, warm start, seed, device): the run's identity and
                    engines from the warm start; where a warm start's weights are; paths as results store them
    rollout.py      the sampler answers each prompt G times, the task scores the answers
    grpo.py         group-normalised advantages, clipped-ratio loss (clip-higher, k3 KL, optional TIS) under the
                    trainer's loss contract
    stability.py    the RL loop (StepConfig): generate -> reward -> trainer recompute -> update -> sync;
                    JSONL per step, resume with the same curve
    checkpoints.py  the run directory: single-writer lock, run id check, atomic checkpoints, step-log truncation
    drift.py        drift alarm (CUSUM on log k3) and reward-collapse detector
    sft.py          cached SFT warm start (bf16 trainer) shared by every arm
    evaluate.py     held-out mean@k per checkpoint with the sampler engine
    config.py       configs/rl/<name>.yaml, one per profile
Tasks (problems, prompts, rewards) are ``minite.tasks``.

Jobs (``python -m minite ...``):
    sft  --model tiny --rl-config cpu --out results/cpu/sft
    rl   --arm A --model tiny --rl-config cpu --steps N --ckpt-every K --checkpoint results/cpu/sft --out results/cpu/A
    eval --arm A --model tiny --rl-config cpu --run results/cpu/A --out results/cpu/A/evals.csv
"""
