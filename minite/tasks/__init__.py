"""minite.tasks: verifiable tasks (problems, token ids, exact rewards) and the prompts the engines need.

    base.py            Problem, TaskError, the Task interface (calibration_prompts, heldout_prompts), sft_batch
    arithmetic.py      multi-digit arithmetic on the char tokenizer (the embedded default)
    long_arithmetic.py long multiplication / addition with a column-by-column scratchpad (200-1000 token
                       answers: the drift study's task)
    math_task.py       real-scale math from a local jsonl/parquet file (``minite[math]``: datasets, math-verify)
    random_prompts.py  seeded random token prompts for a model that has no task here

Used by ``minite.rl`` (training and evaluation) and ``minite.diagnostics`` (probe and calibration prompts).
"""
from __future__ import annotations

from minite.tasks.arithmetic import ArithmeticTask
from minite.tasks.base import Problem, Task, TaskError, sft_batch
from minite.tasks.long_arithmetic import LongArithmeticTask
from minite.tasks.math_task import MathTask, load_hf_tokenizer
from minite.tasks.random_prompts import RandomPrompts
from minite.tokenizer import CharTokenizer


def build_task(cfg: dict, seed: int = 0, tokenizer=None) -> Task:
    """A task from the ``task:`` block of an RL config (``kind: arithmetic``, ``long_arithmetic`` or ``math``)."""
    cfg = dict(cfg or {})
    kind = cfg.pop("kind", "arithmetic")
    if kind == "arithmetic":
        return ArithmeticTask(seed=seed, **cfg)
    if kind == "long_arithmetic":
        return LongArithmeticTask(seed=seed, **cfg)
    if kind == "math":
        return MathTask(seed=seed, tokenizer=tokenizer, **cfg)
    raise TaskError(f"unknown task kind {kind!r} (arithmetic | long_arithmetic | math)")


def task_for_model(task_cfg: dict | None, model_cfg: dict, seed: int = 0):
    """The task a model runs: the RL config's ``task`` block (with the model's own tokenizer loaded when it is
    not the char one), or without a block the default: arithmetic (``ArithmeticTask()``) for char-tokenizer
    models, ``RandomPrompts`` for the others."""
    char = model_cfg.get("tokenizer") in (None, "char")
    if char:
        check_vocab(model_cfg, CharTokenizer.vocab_size)
    if task_cfg is None:
        return ArithmeticTask(seed=seed) if char else RandomPrompts(int(model_cfg["vocab_size"]), seed=seed)
    tok = None if char else load_hf_tokenizer(model_cfg["tokenizer"])
    if tok is not None:
        check_vocab(model_cfg, len(tok))
    return build_task(task_cfg, seed=seed, tokenizer=tok)


def check_vocab(model_cfg: dict, n_ids: int) -> None:
    """The model must embed every id the task's tokenizer emits; else the engines fail only in step 1, with a
    message naming neither the model nor the tokenizer."""
    if int(model_cfg["vocab_size"]) < n_ids:
        which = "the char tokenizer" if model_cfg.get("tokenizer") in (None, "char") else model_cfg["tokenizer"]
        raise TaskError(f"model {model_cfg.get('name')}: vocab_size {model_cfg['vocab_size']} < the {n_ids} ids of "
                        f"{which}; set vocab_size >= {n_ids} in the model config")


__all__ = ["ArithmeticTask", "LongArithmeticTask", "MathTask", "Problem", "RandomPrompts", "Task", "TaskError",
           "build_task", "load_hf_tokenizer", "sft_batch", "task_for_model"]
