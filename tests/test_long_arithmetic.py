"""The long-arithmetic task: exact traces and checker, the difficulty knob, the seed-independent held-out split,
its RL-config block, and SFT / scoring on the tiny model with its gold traces."""
import random

import pytest
import torch

from minite.rl.config import RLConfigError, load_rl_config
from minite.tasks import LongArithmeticTask, TaskError, build_task, sft_batch
from minite.tasks.long_arithmetic import add_trace, mul_trace
from minite.tokenizer import EOS, CharTokenizer


def _columns(trace: str, tag: str) -> list[str]:
    """The numbers written after ``tag`` (y / z rows), least significant digit first."""
    return [part[1:] for part in trace.split(";") if part.startswith(tag)]


@pytest.mark.parametrize("seed", range(20))
def test_traces_are_exact_and_in_the_vocabulary(seed):
    rng = random.Random(seed)
    a, b = rng.randint(1, 10 ** rng.randint(1, 7)), rng.randint(1, 10 ** rng.randint(1, 7))
    for trace, want in ((mul_trace(a, b), a * b), (add_trace(a, b), a + b)):
        CharTokenizer().encode(trace)                                    # every symbol is a char-vocab token
        assert trace.rsplit("=", 1)[1] == str(want)
        assert trace.startswith(f"a{str(a)[::-1]}b{str(b)[::-1]};")
        z = _columns(trace, "z")[-1] if _columns(trace, "z") else _columns(trace, "y")[-1]
        assert int(z[::-1]) == want                                      # the last running sum is the answer
    # every partial product row is a times one digit of b; every step's arithmetic is right
    ys = _columns(mul_trace(a, b), "y")
    assert [int(y[::-1]) for y in ys] == [a * int(d) for d in reversed(str(b))]
    for step in mul_trace(a, b).replace(";", ",").split(","):
        lhs, _, rhs = step.rpartition("=")
        ops = lhs.split(":")[-1]
        if ops and rhs.isdigit() and len(rhs) == 2 and ("*" in ops or ops.count("+") == 2):
            assert eval(ops) == int(rhs), step                           # noqa: S307 (digits and + * only)


def test_difficulty_knob_sets_the_trace_length():
    med = {d: LongArithmeticTask(digits=d).gold_lengths(64)["median"] for d in (2, 3, 4, 5, 6)}
    assert all(med[d] < med[d + 1] for d in (2, 3, 4, 5))
    assert 200 <= med[3] and med[6] <= 1000                              # 3..6 digits span 200-1000 tokens
    base, longer = (LongArithmeticTask(digits=4, digits_b=b).gold_lengths(64)["median"] for b in (4, 8))
    assert 1.8 <= longer / base <= 2.4                                   # digits_b doubles the response
    assert 200 <= LongArithmeticTask(op="add", digits=25).gold_lengths(16)["median"] <= 1000


def test_reward_is_the_exact_final_answer():
    t = LongArithmeticTask(digits=3)
    p = t.train_batch(0, 1)[0]
    gold = t.encode_answer(p)
    assert gold[-1] == EOS and t.reward(p, gold) == 1.0 and t.reward(p, torch.tensor(gold)) == 1.0
    enc = t.tokenizer.encode
    assert t.reward(p, gold[:-1]) == 0.0                                 # no EOS: truncated
    assert t.reward(p, enc("=" + p.answer, bos=False, eos=True)) == 1.0   # outcome reward: the answer decides
    assert t.reward(p, enc("abc;=" + p.answer + "0", bos=False, eos=True)) == 0.0
    assert t.reward(p, enc(p.answer, bos=False, eos=True)) == 0.0       # no '=': no final answer
    assert t.reward(p, gold[:-1] + [EOS, *enc("=1")]) == 1.0             # only what precedes the first EOS counts
    wrong = str(int(p.answer) + 10)                                      # one wrong digit (the tens)
    assert t.reward(p, enc("=" + wrong, bos=False, eos=True)) == 0.0
    pc = LongArithmeticTask(digits=3, partial_credit=True)
    n = len(p.answer)
    assert pc.reward(p, gold) == 1.0
    assert pc.reward(p, enc("=" + wrong, bos=False, eos=True)) == pytest.approx(0.5 * (n - sum(
        x != y for x, y in zip(wrong[::-1], p.answer[::-1], strict=False))) / max(n, len(wrong)))
    assert pc.reward(p, enc("=x", bos=False, eos=True)) == 0.0


def test_split_is_fixed_across_run_seeds_and_disjoint_from_training():
    a, b = LongArithmeticTask(digits=2, seed=0), LongArithmeticTask(digits=2, seed=1)
    assert a.heldout() == b.heldout() and len(a.heldout()) == 256 and len({p.prompt for p in a.heldout()}) == 256
    assert all(a.is_heldout(p) for p in a.heldout())
    train = a.train_batch(3, 500)
    assert not any(a.is_heldout(p) for p in train) and train == LongArithmeticTask(digits=2).train_batch(3, 500)
    assert train != b.train_batch(3, 500)                               # the run seed moves the training stream
    assert LongArithmeticTask(digits=2, split_seed=1).heldout() != a.heldout()
    assert all(len(p.prompt) == 6 and p.prompt[0] != "0" for p in train)  # exactly `digits` digits each


def test_rl_config_block_defaults_and_errors(tmp_path):
    (tmp_path / "p.yaml").write_text("task: {kind: long_arithmetic}\n")
    cfg = load_rl_config(str(tmp_path / "p.yaml"))
    assert cfg["task"] == {"kind": "long_arithmetic", "op": "mul", "digits": 4, "digits_b": None, "split_seed": 0,
                           "heldout_frac": 0.1, "n_heldout": 256, "partial_credit": False}
    t = build_task(cfg["task"], seed=3)
    assert isinstance(t, LongArithmeticTask) and t.digits_b == 4 and t.seed == 3 and t.max_prompt_len == 11
    with pytest.raises(RLConfigError, match="task.ops: unknown field"):   # the arithmetic task's key
        load_rl_config("cpu", {"task.kind": "long_arithmetic"})
    with pytest.raises(TaskError, match="op must be"):
        LongArithmeticTask(op="div")
    with pytest.raises(TaskError, match="digits"):
        LongArithmeticTask(digits=0)


def test_sft_on_gold_traces_and_scoring_on_tiny():
    """The SFT batch teaches the whole scratchpad; the tiny model trains on it and the trainer scores it."""
    from minite.engines.trainer import Trainer
    from minite.rl.sft import evaluate_teacher_forced
    torch.set_num_threads(1)
    t = LongArithmeticTask(digits=2)
    problems = t.train_batch(0, 4, stream="sft")
    b = sft_batch(t, problems)
    n_resp = [len(t.encode_answer(p)) for p in problems]
    assert b["loss_mask"].sum(1).tolist() == n_resp and all(n > 80 for n in n_resp)
    tr = Trainer("bf16", "tiny", lr=3e-3, compute_dtype="float32")
    before = evaluate_teacher_forced(tr, t, t.heldout(4))["nll_per_token"]
    for step in range(5):
        tr.update(sft_batch(t, t.train_batch(step, 8, stream="sft")))
    assert evaluate_teacher_forced(tr, t, t.heldout(4))["nll_per_token"] < before
