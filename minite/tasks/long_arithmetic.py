"""A verifiable long-reasoning task: long multiplication (or addition) worked column by column.

The prompt is the problem, ``<bos>4721*386=``; the gold response is a scratchpad in the char tokenizer's own
symbols, then the answer, then EOS. Multiplication, a x b, with every number in the scratchpad written least
significant digit first (the order the columns are worked in):

    a1274b683;                          the operands restated, digits reversed
    x6:1*6+0=06,2*6+0=12,7*6+1=43,4*6+4=28;y6232;
                                        row i: a times digit b_i, one step per digit of a
                                        ("a_j*b_i+carry=" then carry-out and digit), the partial product y
    x8:1*8+0=08,...;y8763;+:6+0+0=06,2+8+0=10,...;z6...;
                                        rows i >= 1 also add y, shifted by i, into the running sum z, one
                                        column per step ("z_k+y_k+carry=" carry-out and digit); z in full
    ...
    =1822306<eos>                       the answer, most significant digit first

Addition, a + b, is the restated operands, one add row and the sum: ``a...b...;+:...;z...;=...``.
Every step is local (two or three digits and a carry); what makes the task hard is the length (a 4 x 4-digit
product is ~370 tokens, 5 x 5 ~570, 6 x 6 ~820; addition ~9 tokens per digit) and looking up the right digit
of an earlier row: one slip anywhere gives a wrong answer. That is the regime where trainer/sampler drift is
reported to matter (long responses, hard but solvable problems).

The difficulty knob is ``digits`` (operand a has exactly ``digits`` digits, leading digit non-zero);
``digits_b`` (default: ``digits``) sets b's and gives finer steps (the trace length of a product grows with
digits x digits_b). ``gold_lengths(n)`` measures the trace lengths a setting gives.

Reward: 1.0 iff the response contains EOS and the text after its last ``=`` before the first EOS is exactly the
answer (the scratchpad is not checked: an outcome reward). ``partial_credit: true`` (off by default, a
documented variant) gives a wrong answer made of digits 0.5 x the fraction of answer digits it has right,
compared from the least significant end over max(len(answer), len(given)) positions.

Split: a problem is held out iff a keyed hash of its prompt (key ``split_seed``) falls under ``heldout_frac``;
the split does not depend on the run's seed, so runs of several seeds are evaluated on the same held-out list
and never train on it. The training stream is a pure function of (seed, stream, step), as in the arithmetic
task, so a resumed run draws the same problems.
"""
from __future__ import annotations

import random
import statistics

import torch

from minite.tasks.base import GeneratedTask, Problem, TaskError
from minite.tokenizer import EOS, CharTokenizer

OPS = {"mul": "*", "add": "+"}


def _lsb(n: int) -> list[int]:
    """Digits of n, least significant first."""
    return [int(c) for c in reversed(str(n))]


def _text(digits: list[int]) -> str:
    return "".join(map(str, digits))


def _add_columns(z: list[int], y: list[int], shift: int) -> tuple[list[int], list[str]]:
    """z + y * 10**shift on least-significant-first digit lists: (the sum, one step per column from ``shift``)."""
    out, steps, carry, k = list(z[:shift]), [], 0, shift
    while k < len(z) or k - shift < len(y) or carry:
        zk = z[k] if k < len(z) else 0
        yk = y[k - shift] if 0 <= k - shift < len(y) else 0
        v = zk + yk + carry
        steps.append(f"{zk}+{yk}+{carry}={v // 10}{v % 10}")
        out.append(v % 10)
        carry, k = v // 10, k + 1
    return out, steps


def mul_trace(a: int, b: int) -> str:
    """The gold response of a*b (module docstring), without EOS."""
    A, B = _lsb(a), _lsb(b)
    parts, acc = [f"a{_text(A)}b{_text(B)};"], None
    for i, bi in enumerate(B):
        row, steps, carry = [], [], 0
        for aj in A:
            v = aj * bi + carry
            steps.append(f"{aj}*{bi}+{carry}={v // 10}{v % 10}")
            row.append(v % 10)
            carry = v // 10
        if carry:
            row.append(carry)
        parts.append(f"x{bi}:" + ",".join(steps) + f";y{_text(row)};")
        if acc is None:
            acc = row
        else:
            acc, steps = _add_columns(acc, row, i)
            parts.append("+:" + ",".join(steps) + f";z{_text(acc)};")
    return "".join(parts) + f"={a * b}"


def add_trace(a: int, b: int) -> str:
    """The gold response of a+b (module docstring), without EOS."""
    A, B = _lsb(a), _lsb(b)
    total, steps = _add_columns(A, B, 0)
    return f"a{_text(A)}b{_text(B)};+:" + ",".join(steps) + f";z{_text(total)};={a + b}"


class LongArithmeticTask(GeneratedTask):
    """Long multiplication / addition with a column-by-column scratchpad (module docstring)."""

    kind = "long_arithmetic"
    eos_id = EOS

    def __init__(self, op: str = "mul", digits: int = 4, digits_b: int | None = None, seed: int = 0,
                 split_seed: int = 0, heldout_frac: float = 0.1, n_heldout: int = 256, partial_credit: bool = False):
        if op not in OPS:
            raise TaskError(f"op must be one of {sorted(OPS)}, got {op!r}")
        digits_b = digits if digits_b is None else digits_b
        for name, d in (("digits", digits), ("digits_b", digits_b)):
            if not isinstance(d, int) or not 1 <= d <= 200:
                raise TaskError(f"{name} must be an int in 1..200, got {d!r}")
        if not 0.0 < heldout_frac < 1.0:
            raise TaskError(f"heldout_frac must be in (0, 1), got {heldout_frac!r}")
        self.op, self.digits, self.digits_b = op, digits, digits_b
        self.seed, self.split_seed = int(seed), int(split_seed)
        self.heldout_frac, self.n_heldout = float(heldout_frac), int(n_heldout)
        self.partial_credit = bool(partial_credit)
        self.tokenizer = CharTokenizer()
        self._key = f"minite-longarith-{self.split_seed}".encode()
        self._heldout: list[Problem] | None = None

    def config(self) -> dict:
        return {"kind": self.kind, "op": self.op, "digits": self.digits, "digits_b": self.digits_b,
                "seed": self.seed, "split_seed": self.split_seed, "heldout_frac": self.heldout_frac,
                "n_heldout": self.n_heldout, "partial_credit": self.partial_credit}

    # --- problems -------------------------------------------------------------------------------
    def _draw(self, rng: random.Random) -> Problem:
        a = rng.randint(10 ** (self.digits - 1), 10 ** self.digits - 1)
        b = rng.randint(10 ** (self.digits_b - 1), 10 ** self.digits_b - 1)
        return Problem(f"{a}{OPS[self.op]}{b}=", str(a * b if self.op == "mul" else a + b))

    def operands(self, p: Problem) -> tuple[int, int]:
        a, b = p.prompt.rstrip("=").split(OPS[self.op])
        return int(a), int(b)

    def gold(self, p: Problem) -> str:
        """The gold response text (scratchpad, '=', answer; no EOS)."""
        a, b = self.operands(p)
        return mul_trace(a, b) if self.op == "mul" else add_trace(a, b)

    @property
    def max_prompt_len(self) -> int:
        """bos + a + op + b + '='."""
        return 1 + self.digits + 1 + self.digits_b + 1

    def _train_stream(self, stream: str, step: int) -> str:
        return f"longarith-{stream}-{self.seed}-{step}"

    def _heldout_stream(self) -> str:
        return f"longarith-heldout-{self.split_seed}"   # keyed by the split: every seed evaluates the same problems

    def gold_lengths(self, n: int = 256) -> dict:
        """Gold response lengths in tokens (scratchpad + answer + EOS) over ``n`` training problems."""
        lens = [len(self.encode_answer(p)) for p in self.train_batch(0, n, stream="lengths")]
        return {"min": min(lens), "median": statistics.median(lens), "mean": statistics.fmean(lens),
                "max": max(lens), "n": n}

    # --- tokens and rewards ---------------------------------------------------------------------
    def encode_prompt(self, p: Problem) -> list[int]:
        return self.tokenizer.encode(p.prompt, bos=True)

    def encode_answer(self, p: Problem) -> list[int]:
        """The SFT target: the gold scratchpad, '=', the answer, EOS."""
        return self.tokenizer.encode(self.gold(p), bos=False, eos=True)

    def final_answer(self, response_ids) -> str | None:
        """The text after the last '=' before the first EOS; None without EOS or '='."""
        ids = response_ids.tolist() if isinstance(response_ids, torch.Tensor) else list(response_ids)
        if EOS not in ids:
            return None
        text = self.tokenizer.decode(ids[: ids.index(EOS)])
        return text.rsplit("=", 1)[1] if "=" in text else None

    def reward(self, p: Problem, response_ids) -> float:
        given = self.final_answer(response_ids)
        if given is None:
            return 0.0
        if given == p.answer:
            return 1.0
        if not self.partial_credit or not given.isdigit():
            return 0.0
        right = sum(x == y for x, y in zip(reversed(given), reversed(p.answer), strict=False))
        return 0.5 * right / max(len(p.answer), len(given))

    def decode(self, response_ids) -> str:
        return self.tokenizer.decode(response_ids)
