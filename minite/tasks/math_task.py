"""A real-scale math task: problems from a LOCAL jsonl / parquet file, answers checked with math-verify.

Optional dependencies (``pip install 'minite[math]'``): ``datasets`` loads the file (nothing is ever
downloaded: only local paths are accepted), ``math-verify`` parses and compares answers (LaTeX / plain,
``\\boxed{}``, fractions, sets, ...). Both are imported lazily, with an error that says how to install them.

Fields are configurable (``prompt_field``, ``answer_field``); the prompt text is ``template.format(prompt=...)``.
Split: like the arithmetic task, a problem is held out iff a keyed hash (by seed) of its prompt text falls
under ``heldout_frac``; the held-out list is the first ``n_heldout`` of them in file order. Training order:
epoch-wise permutations of the training rows seeded by (seed, epoch); ``train_batch(step, n)`` takes rows
``step * n .. step * n + n - 1`` of that endless sequence, a pure function of (seed, step) for resume.

Reward: 1.0 iff the response ends with the tokenizer's EOS (a truncated response scores 0) and math-verify
judges the decoded response equal to the gold answer, else 0.0.
"""
from __future__ import annotations

import hashlib
import random
from pathlib import Path

import torch

from minite.tasks.base import Problem, Task, TaskError

_INSTALL = "install the optional extra: pip install 'minite[math]' (datasets, math-verify)"


def _require(module: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"the math task needs the package {module!r}: {_INSTALL}") from e


def load_hf_tokenizer(path: str):
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"tokenizer {path!r}: not a local directory (minite never downloads)")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(p), local_files_only=True)


class _Tok:
    """One interface over CharTokenizer and HF tokenizers: encode(text, bos, eos) / decode(ids) / eos id."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_id = tok.eos_token_id
        from minite.tokenizer import CharTokenizer
        self.is_char = isinstance(tok, CharTokenizer)
        if self.eos_id is None:
            raise TaskError("the tokenizer has no eos_token_id: the sampler needs a stop token")

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        if self.is_char:
            return self.tok.encode(text, bos=bos, eos=eos)
        ids = self.tok(text, add_special_tokens=bos)["input_ids"]
        return ids + ([self.eos_id] if eos else [])

    def decode(self, ids) -> str:
        if self.is_char:
            return self.tok.decode(ids)
        return self.tok.decode(ids, skip_special_tokens=True)


def load_rows(path, prompt_field: str, answer_field: str) -> list[Problem]:
    """Rows of a local .jsonl/.json/.parquet file as Problems (raw prompt text, gold answer as a string)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"math task data {str(p)!r} does not exist (a local jsonl/parquet file; "
                                "nothing is downloaded)")
    fmt = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(p.suffix.lower())
    if fmt is None:
        raise TaskError(f"math task data {str(p)!r}: unsupported format {p.suffix!r} (.jsonl, .json, .parquet)")
    datasets = _require("datasets")
    ds = datasets.load_dataset(fmt, data_files=str(p), split="train")
    missing = [f for f in (prompt_field, answer_field) if f not in ds.column_names]
    if missing:
        raise TaskError(f"math task data {str(p)!r}: missing field(s) {missing}; columns are {ds.column_names} "
                        "(set task.prompt_field / task.answer_field)")
    rows = [Problem(str(r[prompt_field]), str(r[answer_field])) for r in ds]
    if not rows:
        raise TaskError(f"math task data {str(p)!r} has no rows")
    return rows


def math_equal(response_text: str, gold: str) -> bool:
    """math-verify's judgement: does the response's final answer equal the gold answer?"""
    mv = _require("math_verify")
    gold_parsed = mv.parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$")
    pred = mv.parse(response_text)
    return bool(gold_parsed) and bool(pred) and bool(mv.verify(gold_parsed, pred))


class MathTask(Task):
    kind = "math"

    def __init__(self, path, prompt_field: str = "problem", answer_field: str = "answer",
                 template: str = "{prompt}", heldout_frac: float = 0.02, n_heldout: int = 500,
                 max_prompt_tokens: int = 1024, seed: int = 0, tokenizer=None):
        if "{prompt}" not in template:
            raise TaskError(f"task.template must contain '{{prompt}}', got {template!r}")
        if not 0.0 < heldout_frac < 1.0:
            raise TaskError(f"heldout_frac must be in (0, 1), got {heldout_frac!r}")
        if tokenizer is None:
            from minite.tokenizer import CharTokenizer
            tokenizer = CharTokenizer()
        self.tok = _Tok(tokenizer)
        self.tokenizer = tokenizer
        self.eos_id = self.tok.eos_id
        self.path, self.seed, self.template = str(path), int(seed), template
        self.prompt_field, self.answer_field = prompt_field, answer_field
        self.heldout_frac, self.n_heldout = float(heldout_frac), int(n_heldout)
        self.max_prompt_len = int(max_prompt_tokens)
        self._key = f"minite-math-{self.seed}".encode()
        self._perm: tuple[int, list[int]] = (-1, [])
        rows = [r for r in load_rows(path, prompt_field, answer_field)
                if len(self.encode_prompt(r)) <= self.max_prompt_len]   # too-long prompts are dropped up front
        self.train = [r for r in rows if not self.is_heldout(r)]
        self._heldout = [r for r in rows if self.is_heldout(r)][: self.n_heldout]
        if not self.train or not self._heldout:
            raise TaskError(f"{self.path}: the split left {len(self.train)} training and {len(self._heldout)} "
                            f"held-out rows (of {len(rows)} usable); adjust heldout_frac or add data")

    def config(self) -> dict:
        return {"kind": self.kind, "path": self.path, "prompt_field": self.prompt_field,
                "answer_field": self.answer_field, "template": self.template, "seed": self.seed,
                "heldout_frac": self.heldout_frac, "n_heldout": self.n_heldout,
                "max_prompt_tokens": self.max_prompt_len, "n_train": len(self.train)}

    def is_heldout(self, p: Problem) -> bool:
        h = hashlib.blake2b(p.prompt.encode(), key=self._key, digest_size=8).digest()
        return int.from_bytes(h, "big") / 2 ** 64 < self.heldout_frac

    def _order(self, epoch: int) -> list[int]:
        if self._perm[0] != epoch:      # one epoch's permutation cached (batches walk epochs in order)
            idx = list(range(len(self.train)))
            random.Random(f"math-{self.seed}-{epoch}").shuffle(idx)
            self._perm = (epoch, idx)
        return self._perm[1]

    def train_batch(self, step: int, n: int, stream: str = "rl") -> list[Problem]:
        if stream != "rl":              # sft / calibration streams: their own order
            rng = random.Random(f"math-{stream}-{self.seed}-{step}")
            return [self.train[rng.randrange(len(self.train))] for _ in range(n)]
        N, out, pos = len(self.train), [], step * n
        for q in range(pos, pos + n):
            out.append(self.train[self._order(q // N)[q % N]])
        return out

    def heldout(self, n: int | None = None) -> list[Problem]:
        return self._heldout[: n or self.n_heldout]

    def encode_prompt(self, p: Problem) -> list[int]:
        return self.tok.encode(self.template.format(prompt=p.prompt), bos=True)

    def encode_answer(self, p: Problem) -> list[int]:
        return self.tok.encode(p.answer, bos=False, eos=True)

    def reward(self, p: Problem, response_ids) -> float:
        ids = response_ids.tolist() if isinstance(response_ids, torch.Tensor) else list(response_ids)
        if self.eos_id not in ids:
            return 0.0
        return float(math_equal(self.tok.decode(ids[: ids.index(self.eos_id)]), p.answer))
