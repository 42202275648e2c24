"""A verifiable synthetic task: multi-digit arithmetic with exact answer checking (char tokenizer).

A problem is ``Problem(prompt="12+34=", answer="46")``; the model sees ``<bos>12+34=`` and must produce
``46<eos>``. The reward is exact: 1.0 iff the response tokens up to and including the first EOS are exactly
``encode("46") + [EOS]`` (no skipped pad/bos tricks, no truncated answer), else 0.0.

Difficulty: ``digits`` (operands have 1..digits digits, uniformly over the numbers 0..10**digits-1) and
``ops`` (any of ``+ - *`` and ``/``; division problems are built as (b*q)/b so the answer is an exact
integer; subtraction may give a negative answer "-12", '-' is in the vocabulary).

Train / held-out split: deterministic by ``seed``. A problem is held out iff a keyed hash of its prompt falls
under ``heldout_frac`` (blake2b keyed by the seed: same split on every machine and Python, independent of
the order problems are drawn). Training batches never contain a held-out problem; the held-out set is a
fixed list drawn by rejection from the held-out side of the split. The training data order is a pure
function of (seed, step): ``train_batch(step, n)`` needs no state, so a resumed run sees the same prompts.
"""
from __future__ import annotations

import random

import torch

from minite.tasks.base import GeneratedTask, Problem, TaskError
from minite.tokenizer import EOS, CharTokenizer

OPS = ("+", "-", "*", "/")


class ArithmeticTask(GeneratedTask):
    """Multi-digit arithmetic ("12+34=" -> "46") with a deterministic held-out split."""

    kind = "arithmetic"
    eos_id = EOS

    def __init__(self, digits: int = 2, ops=("+",), seed: int = 0, heldout_frac: float = 0.1,
                 n_heldout: int = 128):
        ops = tuple(ops)
        if not isinstance(digits, int) or not 1 <= digits <= 6:
            raise TaskError(f"digits must be an int in 1..6, got {digits!r}")
        if not ops or any(o not in OPS for o in ops):
            raise TaskError(f"ops must be a non-empty subset of {OPS}, got {ops!r}")
        if not 0.0 < heldout_frac < 1.0:
            raise TaskError(f"heldout_frac must be in (0, 1), got {heldout_frac!r}")
        self.digits, self.ops, self.seed = digits, ops, int(seed)
        self.heldout_frac, self.n_heldout = float(heldout_frac), int(n_heldout)
        self.tokenizer = CharTokenizer()
        self._key = f"minite-arith-{self.seed}".encode()
        self._heldout: list[Problem] | None = None

    def config(self) -> dict:
        return {"kind": self.kind, "digits": self.digits, "ops": list(self.ops), "seed": self.seed,
                "heldout_frac": self.heldout_frac, "n_heldout": self.n_heldout}

    # --- problems -------------------------------------------------------------------------------
    def _draw(self, rng: random.Random) -> Problem:
        hi = 10 ** self.digits - 1
        op = rng.choice(self.ops)
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        if op == "+":
            ans = a + b
        elif op == "-":
            ans = a - b
        elif op == "*":
            ans = a * b
        else:  # exact integer division: dividend = divisor * quotient
            b = max(b, 1)
            ans, a = a, a * b
        return Problem(f"{a}{op}{b}=", str(ans))

    @property
    def max_prompt_len(self) -> int:
        """Longest prompt in tokens: bos + a + op + b + '=' (a dividend has up to 2 x digits digits)."""
        return 1 + (2 if "/" in self.ops else 1) * self.digits + 1 + self.digits + 1

    def _train_stream(self, stream: str, step: int) -> str:
        return f"train-{stream}-{self.seed}-{step}"

    def _heldout_stream(self) -> str:
        return f"heldout-{self.seed}"

    # --- tokens and rewards ---------------------------------------------------------------------
    def encode_prompt(self, p: Problem) -> list[int]:
        return self.tokenizer.encode(p.prompt, bos=True)

    def encode_answer(self, p: Problem) -> list[int]:
        """The SFT target: answer tokens + EOS."""
        return self.tokenizer.encode(p.answer, bos=False, eos=True)

    def reward(self, p: Problem, response_ids) -> float:
        """1.0 iff the response up to and including its first EOS is exactly answer + EOS."""
        ids = response_ids.tolist() if isinstance(response_ids, torch.Tensor) else list(response_ids)
        if EOS not in ids:
            return 0.0
        return float(ids[: ids.index(EOS) + 1] == self.encode_answer(p))

    def decode(self, response_ids) -> str:
        return self.tokenizer.decode(response_ids)

