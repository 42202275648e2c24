"""What every task is: problems with exact answers, their token ids, and the prompts the engines need.

A task turns problems (``Problem(prompt, answer)``) into token ids and rewards, and splits them into a
training stream (``train_batch(step, n, stream)``: a pure function of the seed, the stream and the step) and
a fixed held-out list (``heldout(n)``). From those, every task offers the two prompt sets the engines use:

    calibration_prompts(n)   step 0 of the "calib" training stream: the batch a sampler with static activation
                             scales calibrates on (the same on every call, so a resumed run gets the same scales)
    heldout_prompts(n)       the first n held-out prompts: what the diagnostics sample from and probe with

``sft_batch(task, problems)`` is the teacher-forcing batch of a task's problems.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch

from minite.tokenizer import PAD


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class TaskError(ValueError):
    """A malformed task configuration or data source."""


class Task:
    """The interface of a task; subclasses define the problems, their encoding and the reward."""

    kind: str = "task"
    eos_id: int
    max_prompt_len: int

    def config(self) -> dict:
        raise NotImplementedError

    def train_batch(self, step: int, n: int, stream: str = "rl") -> list[Problem]:
        raise NotImplementedError

    def heldout(self, n: int | None = None) -> list[Problem]:
        raise NotImplementedError

    def encode_prompt(self, p: Problem) -> list[int]:
        raise NotImplementedError

    def encode_answer(self, p: Problem) -> list[int]:
        raise NotImplementedError

    def reward(self, p: Problem, response_ids) -> float:
        raise NotImplementedError

    def calibration_prompts(self, n: int) -> list[list[int]]:
        """``n`` training prompts (never held out) for static activation-scale calibration."""
        return [self.encode_prompt(p) for p in self.train_batch(0, n, stream="calib")]

    def heldout_prompts(self, n: int) -> list[list[int]]:
        """The first ``n`` held-out prompts; a clear error when the task holds fewer."""
        problems = self.heldout(n)
        if len(problems) < n:
            raise TaskError(f"{n} held-out prompts asked for, the {self.kind} task holds {len(problems)} "
                            "(raise task.n_heldout)")
        return [self.encode_prompt(p) for p in problems]


class GeneratedTask(Task):
    """A task whose problems come from a seeded generator (``_draw``), split into train / held-out by a keyed
    hash of the prompt. Subclasses set ``heldout_frac``, ``n_heldout``, ``_key`` (the hash key: the split) and
    ``_heldout = None``, and name their random streams (``_train_stream``, ``_heldout_stream``), so a resumed
    run, or another seed sharing the split, draws exactly the same problems."""

    heldout_frac: float
    n_heldout: int
    _key: bytes
    _heldout: list[Problem] | None

    def _draw(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def _train_stream(self, stream: str, step: int) -> str:
        raise NotImplementedError

    def _heldout_stream(self) -> str:
        raise NotImplementedError

    def is_heldout(self, p: Problem) -> bool:
        h = hashlib.blake2b(p.prompt.encode(), key=self._key, digest_size=8).digest()
        return int.from_bytes(h, "big") / 2 ** 64 < self.heldout_frac

    def _draw_side(self, rng: random.Random, heldout: bool) -> Problem:
        for _ in range(100_000):
            p = self._draw(rng)
            if self.is_heldout(p) == heldout:
                return p
        raise TaskError("could not draw a problem on this side of the split (problem space too small?)")

    def train_batch(self, step: int, n: int, stream: str = "rl") -> list[Problem]:
        """The ``n`` training problems of step ``step`` of a data stream ("rl", "sft", "calib", ...): a pure
        function of (seed, stream, step), so a resumed run draws the same problems."""
        rng = random.Random(self._train_stream(stream, step))
        return [self._draw_side(rng, heldout=False) for _ in range(n)]

    def heldout(self, n: int | None = None) -> list[Problem]:
        """The fixed held-out evaluation set (first ``n`` of ``n_heldout`` problems; distinct prompts)."""
        if self._heldout is None:
            rng, seen, out = random.Random(self._heldout_stream()), set(), []
            for _ in range(200 * self.n_heldout):
                p = self._draw_side(rng, heldout=True)
                if p.prompt not in seen:
                    seen.add(p.prompt)
                    out.append(p)
                if len(out) == self.n_heldout:
                    break
            self._heldout = out
        return self._heldout[: n or self.n_heldout]


def sft_batch(task: Task, problems: list[Problem]) -> dict:
    """Teacher-forcing batch for the trainer: prompt + answer + EOS, right-padded with PAD; loss on the
    answer tokens and EOS (``loss_mask[b, t] = 1`` means token t is trained, predicted from tokens < t)."""
    seqs, masks = [], []
    for p in problems:
        pr, an = task.encode_prompt(p), task.encode_answer(p)
        seqs.append(pr + an)
        masks.append([0] * len(pr) + [1] * len(an))
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), PAD, dtype=torch.long)
    att = torch.zeros((len(seqs), T), dtype=torch.long)
    lm = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
        lm[i, : len(m)] = torch.tensor(m)
    return {"input_ids": ids, "attention_mask": att, "loss_mask": lm}
