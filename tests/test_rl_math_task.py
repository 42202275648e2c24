"""The local-file math task: loading with `datasets`, field names, split, clear errors, math-verify reward."""
import json

import pytest

from minite.tasks import Problem, TaskError, build_task
from minite.tokenizer import CharTokenizer

pytest.importorskip("datasets")


@pytest.fixture()
def data(tmp_path):
    p = tmp_path / "train.jsonl"
    rows = [{"q": f"{a}+{b}=", "sol": str(a + b), "other": 1} for a in range(20) for b in range(10)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_loader_split_and_order(data):
    t = build_task({"kind": "math", "path": str(data), "prompt_field": "q", "answer_field": "sol",
                    "heldout_frac": 0.1, "n_heldout": 8}, seed=0)
    assert len(t.heldout()) == 8 and 150 < len(t.train) < 195
    assert not {p.prompt for p in t.heldout()} & {p.prompt for p in t.train}
    b0 = t.train_batch(0, 16)
    assert b0 == t.train_batch(0, 16) and b0 != t.train_batch(1, 16)
    # one epoch of batches visits every training row exactly once
    n = len(t.train)
    seen = [p.prompt for s in range(n // 4) for p in t.train_batch(s, 4)]
    assert len(set(seen)) == len(seen) == (n // 4) * 4
    assert t.encode_prompt(Problem("1+2=", "3")) == CharTokenizer().encode("1+2=")
    assert t.config()["n_train"] == len(t.train)


def test_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    p = tmp_path / "d.parquet"
    pd.DataFrame({"problem": [f"{i}*2=" for i in range(100)], "answer": [str(2 * i) for i in range(100)]}).to_parquet(p)
    t = build_task({"kind": "math", "path": str(p), "heldout_frac": 0.2, "n_heldout": 5}, seed=1)
    assert len(t.heldout()) == 5 and t.train[0].answer == str(2 * int(t.train[0].prompt[:-3]))


def test_clear_errors(data, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_task({"kind": "math", "path": str(tmp_path / "nope.jsonl")})
    with pytest.raises(TaskError, match="missing field"):
        build_task({"kind": "math", "path": str(data), "prompt_field": "question"})
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n")
    with pytest.raises(TaskError, match="unsupported format"):
        build_task({"kind": "math", "path": str(bad)})


def test_math_verify_reward(data):
    pytest.importorskip("math_verify")
    from minite.tasks.math_task import math_equal

    assert math_equal("so the answer is \\boxed{\\frac{1}{2}}", "0.5")
    assert math_equal("$x = 3$", "3")
    assert not math_equal("\\boxed{4}", "3")
    t = build_task({"kind": "math", "path": str(data), "prompt_field": "q", "answer_field": "sol"}, seed=0)
    tok = CharTokenizer()
    p = Problem("1+2=", "3")
    assert t.reward(p, tok.encode("3", bos=False, eos=True)) == 1.0
    assert t.reward(p, tok.encode("4", bos=False, eos=True)) == 0.0
    assert t.reward(p, tok.encode("3", bos=False)) == 0.0          # truncated: no EOS
