"""The distributed pieces in one process (fast): a world of one, the jobs that refuse torchrun, activation
checkpointing, the optimizer-state forms of the checkpoints, the sharded sync's tile rule. The two-process
tests are tests/test_distributed.py and tests/test_distributed_rl.py (slow)."""
import pytest
import torch

from minite import distributed as D
from minite.engines import fsdp
from minite.engines.arms import ARMS
from minite.engines.sharded_sync import _tile_aligned
from minite.engines.trainer import Trainer


def _batch(b=4, t=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 32, (b, t), generator=g)
    ids[:, 0] = 1
    lm = torch.ones_like(ids)
    lm[:, :5] = 0
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": lm}


def test_a_world_of_one():
    assert not D.launched() and not D.active() and D.world_size() == 1 and D.rank() == 0 and D.is_main()
    assert D.row_share(6) == slice(0, 6)
    assert D.all_reduce([1.5, 2.0]).tolist() == [1.5, 2.0] and D.all_gather_object({"a": 1}) == [{"a": 1}]
    t = torch.arange(6).view(3, 2)
    assert D.all_gather_rows(t) is t and D.broadcast_object(3) == 3
    tr = Trainer("bf16", "tiny")
    assert not tr.sharded and tr.master[0] is not tr.params[0]
    with pytest.raises(RuntimeError, match="torchrun"):
        Trainer("bf16", "tiny", shard=True)


def test_row_share_needs_an_even_split(monkeypatch):
    monkeypatch.setattr(D, "world_size", lambda: 4)
    monkeypatch.setattr(D, "rank", lambda: 2)
    assert D.row_share(8) == slice(4, 6)
    with pytest.raises(ValueError, match="6 sequences do not split evenly over 4 ranks"):
        D.row_share(6, "sequences")


def test_jobs_without_distributed_support_refuse_torchrun(monkeypatch, caplog):
    from minite.cli import main
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["diagnose", "--arm", "bf16", "--model", "tiny", "--out", "/nonexistent/x"]) == 2
    assert "diagnose runs in one process" in caplog.text
    import importlib
    for job in ("bench_learner", "rl", "sft", "evaluate"):
        assert importlib.import_module(f"minite.jobs.{job}").DISTRIBUTED


@pytest.mark.parametrize("arm", ARMS)
def test_activation_checkpointing_gives_the_same_update(arm):
    """Recomputing each layer's forward in backward changes no number (stochastic rounding included: the forward
    draws none, the backward draws in the same order)."""
    out = []
    for ac in (False, True):
        tr = Trainer(arm, "tiny", seed=2, lr=1e-3, micro_batch_size=2, activation_checkpointing=ac)
        res = tr.update(_batch())
        out.append((res, [m.clone() for m in tr.master]))
    assert out[0][0]["loss"] == out[1][0]["loss"] and out[0][0]["grad_norm"] == out[1][0]["grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1], strict=True))


def test_rounding_streams_follow_rows_not_slicing():
    """The naive arm's stochastic rounding is seeded per micro-batch by its first row: two trainers that slice
    the same batch the same way agree bitwise, and the stream moves on with every update."""
    a = Trainer("naive_te_nvfp4", "tiny", seed=4, micro_batch_size=2)
    b = Trainer("naive_te_nvfp4", "tiny", seed=4, micro_batch_size=2)
    b.qstate.generator.manual_seed(123)          # whatever state it was left in does not matter
    ra, rb = a.update(_batch()), b.update(_batch())
    assert ra["grad_norm"] == rb["grad_norm"]
    a.update(_batch())
    c = Trainer("naive_te_nvfp4", "tiny", seed=5, micro_batch_size=2)
    assert c.update(_batch())["grad_norm"] != ra["grad_norm"]    # another seed, other rounding


def test_optimizer_state_forms_round_trip():
    tr = Trainer("bf16", "tiny", lr=1e-3)
    tr.update(_batch())
    osd = tr.optimizer.state_dict()
    by_name = fsdp.optimizer_by_name(osd, tr.names)
    assert set(by_name["state"]) == set(tr.names) and by_name["param_groups"][0]["params"] == tr.names
    back = fsdp.optimizer_by_index(by_name, tr.names)
    assert back["param_groups"] == osd["param_groups"]
    assert all(torch.equal(back["state"][i]["exp_avg"], osd["state"][i]["exp_avg"]) for i in osd["state"])


def test_codes_travel_only_on_tile_boundaries():
    assert _tile_aligned(4096, 16, 8) and _tile_aligned(128, 16, 2)
    assert not _tile_aligned(128, 16, 3)            # 43-row shards
    assert not _tile_aligned(16, 16, 2)             # a rank would hold no row
    assert _tile_aligned(8, 1, 2)                   # 1x16 tiles: any row split
