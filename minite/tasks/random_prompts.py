"""Seeded random token prompts: the prompt source for a model that has no task here.

A model with its own (HF) tokenizer and no data file still has engines to calibrate and compare: random
token ids after BOS exercise every GEMM and expert path alike. Fine for measuring the engines; there are no
answers, so nothing to train on.
"""
from __future__ import annotations

import torch

from minite.tokenizer import BOS

# the held-out stream keeps the plain seed (the diagnostics' probe prompts); calibration draws its own
_CALIB_STREAM = 1_000_003


class RandomPrompts:
    kind = "random"

    def __init__(self, vocab_size: int, seed: int = 0, length: int = 12):
        if vocab_size <= 3:
            raise ValueError(f"random prompts need a vocabulary beyond the 3 special ids, got {vocab_size}")
        self.vocab_size, self.seed, self.length = int(vocab_size), int(seed), int(length)
        self.max_prompt_len = 1 + self.length

    def config(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "seed": self.seed, "length": self.length}

    def _prompts(self, n: int, seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return [[BOS] + torch.randint(3, self.vocab_size, (self.length,), generator=g).tolist() for _ in range(n)]

    def heldout_prompts(self, n: int) -> list[list[int]]:
        return self._prompts(n, self.seed)

    def calibration_prompts(self, n: int) -> list[list[int]]:
        return self._prompts(n, self.seed + _CALIB_STREAM)
