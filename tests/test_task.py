"""The synthetic arithmetic task: generation, exact checking, deterministic split, SFT batches."""
import pytest
import torch

from minite.tasks import ArithmeticTask, Problem, TaskError, build_task, sft_batch
from minite.tokenizer import BOS, EOS, PAD, CharTokenizer


def _solve(prompt: str) -> int:
    a, op, b = next((prompt[:i], c, prompt[i + 1:-1]) for i, c in enumerate(prompt) if i > 0 and c in "+-*/")
    a, b = int(a), int(b)
    return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a // b}[op]()


@pytest.mark.parametrize("digits,ops", [(1, ["+"]), (2, ["+"]), (3, ["+", "-", "*", "/"])])
def test_problems_are_correct_and_in_vocab(digits, ops):
    t = ArithmeticTask(digits=digits, ops=ops, seed=3)
    for p in t.train_batch(0, 200) + t.heldout(50):
        assert p.prompt.endswith("=") and int(p.answer) == _solve(p.prompt)
        if "/" in p.prompt:
            a, b = p.prompt[:-1].split("/")
            assert int(a) % int(b) == 0                       # exact integer division
        ids = t.encode_prompt(p)
        assert ids[0] == BOS and len(ids) <= t.max_prompt_len
        assert t.encode_answer(p)[-1] == EOS


def test_reward_is_exact():
    t, tok = ArithmeticTask(), CharTokenizer()
    p = Problem("12+34=", "46")
    assert t.reward(p, tok.encode("46", bos=False, eos=True)) == 1.0
    assert t.reward(p, tok.encode("46", bos=False, eos=True) + [PAD, PAD]) == 1.0
    assert t.reward(p, torch.tensor(tok.encode("46", bos=False, eos=True) + [7])) == 1.0  # after EOS: ignored
    assert t.reward(p, tok.encode("46", bos=False)) == 0.0           # truncated: no EOS
    assert t.reward(p, tok.encode("47", bos=False, eos=True)) == 0.0
    assert t.reward(p, tok.encode("460", bos=False, eos=True)) == 0.0
    assert t.reward(p, [BOS] + tok.encode("46", bos=False, eos=True)) == 0.0  # no skipped-token tricks
    assert t.reward(p, [EOS]) == 0.0


def test_split_is_deterministic_and_disjoint():
    a, b, c = ArithmeticTask(seed=0), ArithmeticTask(seed=0), ArithmeticTask(seed=1)
    assert a.train_batch(5, 64) == b.train_batch(5, 64)
    assert a.train_batch(5, 64) != a.train_batch(6, 64)
    assert a.train_batch(5, 64) != a.train_batch(5, 64, stream="sft")
    assert a.heldout() == b.heldout() and a.heldout() != c.heldout()
    held = {p.prompt for p in a.heldout()}
    assert len(held) == a.n_heldout                         # distinct prompts
    train = {p.prompt for s in range(50) for p in a.train_batch(s, 64)}
    assert not held & train
    assert all(a.is_heldout(Problem(q, "")) for q in held)
    frac = sum(a.is_heldout(Problem(f"{i}+{j}=", "")) for i in range(100) for j in range(100)) / 1e4
    assert 0.07 < frac < 0.13                               # heldout_frac = 0.1 of the problem space


def test_sft_batch_layout():
    t = ArithmeticTask()
    ps = [Problem("1+2=", "3"), Problem("12+34=", "46")]
    b = sft_batch(t, ps)
    ids, lm, att = b["input_ids"], b["loss_mask"], b["attention_mask"]
    assert ids.shape == (2, 10) and ids[0, -3:].tolist() == [PAD] * 3
    assert CharTokenizer().decode(ids[1]) == "12+34=46"
    assert lm[1].tolist() == [0] * 7 + [1, 1, 1]              # bos 1 2 + 3 4 = | 4 6 eos
    # loss on the answer tokens and EOS only
    assert [int(i) for i, m in zip(ids[1], lm[1], strict=True) if m] == t.encode_answer(ps[1])
    assert [int(i) for i, m in zip(ids[0], lm[0], strict=True) if m] == t.encode_answer(ps[0])
    assert att[0].tolist() == [1] * 7 + [0] * 3


@pytest.mark.parametrize("kw", [{"digits": 0}, {"ops": ["^"]}, {"ops": []}, {"heldout_frac": 1.0}])
def test_bad_config(kw):
    with pytest.raises(TaskError):
        ArithmeticTask(**kw)
    with pytest.raises(TaskError):
        build_task({"kind": "chess"})
