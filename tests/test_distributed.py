"""The FSDP2 learner and the sharded weight sync on two gloo processes (CPU), against one process.

Two processes run one update of ``tiny`` for every arm on their halves of a batch; one process runs the same
update on the whole batch in micro-batches of the same halves. Then: gradients, parameters and optimizer
state agree (bitwise without clipping, within the bound below with it), the NVFP4 codes each rank computes
with are the one-process codes, both ranks receive the payload one process ships, checkpoints cross between
the single-process file and the sharded DCP directory, activation checkpointing under FSDP changes no number,
and after a sharded update and sync the miniTE trainer and sampler log-probs are bitwise equal; bench-learner
runs under torchrun.

Tolerance, from the reduction order. AdamW's first step from a zero state (bias-corrected, weight decay 0)
moves every parameter by  d = -lr * h / (|h| + eps),  h = c * g,  g the fp32 gradient and
c = min(1, max_norm / (||g|| + 1e-6)) the clipping factor.
  1. g. One process accumulates its two micro-batch gradients in fp32, (0 + g1) + g2; two ranks, one micro-batch
     each, reduce-scatter the SUM g1 + g2 in fp32. Each g_i is the same BF16 tensor (the same rows, the same BF16
     weights gathered from the same fp32 masters, the same stochastic-rounding seed, which the trainer derives
     from the micro-batch's first row), and the fp32 sum of two numbers is commutative and correctly rounded:
     g is bitwise equal. Without clipping everything downstream is element-wise, so gradients, parameters and
     AdamW moments are bitwise equal (asserted).
  2. ||g||. One process reduces each whole tensor, the ranks reduce their shards and then the shards' squares:
     two orders of summing N <= 2^20 non-negative squares. Pairwise summation errs by at most ~log2(N) u per sum
     (u = 2^-24), so the two norms differ by rho <= 2 * 20 u ~ 2.4e-6 relative; asserted rho <= 1e-5 (the
     reported norms differ so with and without clipping; without, nothing is scaled by them).
  3. h = c * g: each c = max_norm / (||g|| + 1e-6) rounds twice (2u each side) on top of rho, and each product
     rounds once more: |h1 - h2| <= (rho + 6u) |h| (measured: ~3.5u with rho ~1.1u).
  4. d: for f(x) = x / (|x| + eps),  |f(x(1 + r)) - f(x)| <= eps |x| r / (|x| + eps)^2 <= r / 4 (the maximum of
     eps x / (x + eps)^2 is 1/4, at x = eps), so |d1 - d2| <= lr (rho + 6u) / 4, plus the few roundings of the
     update itself (<= 8u lr), plus one rounding of theta + d (one ulp, <= 2u |theta'|).
  So |theta1 - theta2| <= lr (rho + 6u) / 4 + 8u lr + 2u |theta|  (asserted with the measured rho), while a
  wrong normalisation (a per-rank token count, a mean instead of a sum) moves gradients by factors of ~2.
"""
import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from minite import nvfp4
from minite.engines.arms import ARMS
from minite.engines.trainer import Trainer

pytestmark = pytest.mark.slow       # two processes: ~1 minute on 2 busy cores

U = 2.0 ** -24
LR = 1e-3
ROWS = 4


def _batch():
    """4 rows, right-padded, uneven loss tokens across the two halves (the normalisation is global)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 32, (ROWS, 24), generator=g)
    ids[:, 0] = 1
    am = torch.ones_like(ids)
    for row, pad in ((0, 0), (1, 3), (2, 9), (3, 14)):
        if pad:
            am[row, -pad:] = 0
            ids[row, -pad:] = 0
    lm = am.clone()
    lm[:, :4] = 0
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _codes_in_use(trainer) -> dict:
    """The NVFP4 codes each quantized module computed with in the last forward: its per-update cache (an arm
    that quantizes every forward keeps none; its bitwise gradients speak for its codes)."""
    out = {}
    if not trainer.qstate.cache_per_update:
        return out
    for name, mod in trainer.model.named_modules():
        if hasattr(mod, "quantized") and hasattr(mod, "cache"):
            out[name] = mod.quantized().codes.clone()
        q = getattr(mod, "minite_quant", None)
        if q is not None:
            out[name + ".gate_up"] = q.gate_up.get(mod.gate_up_proj).codes.clone()
            out[name + ".down"] = q.down.get(mod.down_proj).codes.clone()
    return out


def _same(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, nvfp4.NVFP4Tensor):
        return (torch.equal(a.codes, b.codes) and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
                and a.global_scale.shape == b.global_scale.shape and torch.equal(a.global_scale, b.global_scale))
    return a.dtype == b.dtype and torch.equal(a, b)


def _same_payload(p, q) -> bool:
    return p["form"] == q["form"] and p["tensors"].keys() == q["tensors"].keys() and \
        all(_same(p["tensors"][k], q["tensors"][k]) for k in p["tensors"])


# ------------------------------------------------------------------------------------------ the two ranks
def _ranks(rank: int, world: int, port: int, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from minite import distributed as D
    from minite.engines.fsdp import full_value
    from minite.engines.sampler import Sampler
    from minite.engines.sync import sync_weights
    D.init()
    batch = {k: v[D.row_share(ROWS)] for k, v in _batch().items()}
    report = {}
    for arm in ARMS:
        for clip in (1.0, None):
            tag = f"{arm}_{'clip' if clip else 'noclip'}"
            tr = Trainer(arm, "tiny", seed=3, lr=LR, grad_clip=clip)
            assert tr.sharded
            res = tr.update(batch)
            grads = {n: full_value(p.grad) for n, p in zip(tr.names, tr.params, strict=True)}
            tr.save(f"{tmp}/{tag}.dcp")
            payload = tr.export_weights()
            lp = tr.logprobs(batch["input_ids"], batch["attention_mask"])
            codes = _codes_in_use(tr)
            torch.save({"payload": payload, "grads": grads, "codes": codes, "logprobs": lp},
                       f"{tmp}/{tag}.rank{rank}.pt")
            report[tag] = {"loss": res["loss"], "grad_norm": res["grad_norm"], "tokens": res["tokens"],
                           "sync": tr.last_export}
        # activation checkpointing around the FSDP layers changes no number
        tr = Trainer(arm, "tiny", seed=3, lr=LR, grad_clip=None, activation_checkpointing=True)
        tr.update(batch)
        torch.save({n: full_value(p.grad) for n, p in zip(tr.names, tr.params, strict=True)},
                   f"{tmp}/{arm}_ac.rank{rank}.pt")
        # the single-process checkpoint file, loaded by the sharded trainer, ships what one process ships
        tr = Trainer(arm, "tiny", seed=11, lr=LR)
        tr.load(f"{tmp}/{arm}.single.pt")
        torch.save(tr.export_weights(), f"{tmp}/{arm}.from_single.rank{rank}.pt")
    # miniTE after a sharded update and sync: trainer and sampler log-probs bitwise equal on every rank
    tr = Trainer("minite_nvfp4", "tiny", seed=3, lr=LR)
    tr.update(batch)
    sa = Sampler(tr.arm, tr.model_cfg, max_batch=ROWS)
    sync_weights(tr, sa)
    ids = _batch()["input_ids"][:, :14].clone()
    ids[ids == 0] = 5
    lens = torch.tensor([4, 6, 5, 7])
    lp_t, lp_s = tr.logprobs(ids), sa.score(ids, lens)
    report["bitwise"] = all(torch.equal(lp_t[b, lens[b] - 1:], lp_s[b, lens[b]:]) for b in range(ROWS))
    if rank == 0:
        with open(f"{tmp}/report.json", "w") as f:
            json.dump(report, f)
    D.shutdown()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One process per arm and clipping (the references, saved as single-process checkpoints), then the two
    ranks; returns (tmp dir, references, the ranks' report)."""
    tmp = tmp_path_factory.mktemp("dist")
    torch.set_num_threads(1)
    refs = {}
    for arm in ARMS:
        for clip in (1.0, None):
            tag = f"{arm}_{'clip' if clip else 'noclip'}"
            tr = Trainer(arm, "tiny", seed=3, lr=LR, grad_clip=clip, micro_batch_size=ROWS // 2)
            res = tr.update(_batch())
            tr.logprobs(_batch()["input_ids"], _batch()["attention_mask"])
            refs[tag] = {"res": res, "trainer": tr, "codes": _codes_in_use(tr),
                         "grads": {n: m.grad.clone() for n, m in zip(tr.names, tr.master, strict=True)}}
            if clip:
                tr.save(tmp / f"{arm}.single.pt")
    mp.spawn(_ranks, args=(2, _free_port(), str(tmp)), nprocs=2, join=True)
    return tmp, refs, json.loads((tmp / "report.json").read_text())


@pytest.mark.parametrize("arm", ARMS)
def test_two_ranks_update_like_one_process(two_ranks, arm):
    tmp, refs, report = two_ranks
    for tag in (f"{arm}_noclip", f"{arm}_clip"):
        ref, got = refs[tag], report[tag]
        ranks = [torch.load(tmp / f"{tag}.rank{r}.pt", weights_only=False) for r in (0, 1)]
        assert got["loss"] == ref["res"]["loss"] and got["tokens"] == ref["res"]["tokens"]
        sharded = Trainer(arm, "tiny", seed=11, lr=LR)          # the ranks' DCP checkpoint, in one process
        sharded.load(tmp / f"{tag}.dcp")
        assert sharded.update_count == 1
        one = ref["trainer"]
        rho = abs(got["grad_norm"] - ref["res"]["grad_norm"]) / ref["res"]["grad_norm"]
        assert rho <= 1e-5                                      # (2), reported with or without clipping
        if tag.endswith("noclip"):                              # (1): bitwise
            for n in one.names:
                assert torch.equal(ranks[0]["grads"][n], ref["grads"][n]), n
            for a, b in zip(one.master, sharded.master, strict=True):
                assert torch.equal(a, b)
            for i, a in enumerate(one.master):
                sa, sb = one.optimizer.state[a], sharded.optimizer.state[sharded.master[i]]
                assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        else:                                                   # (3)-(4): the derived bound
            for n in one.names:
                h1, h2 = ref["grads"][n], ranks[0]["grads"][n]
                assert ((h1 - h2).abs() <= (rho + 6 * U) * h1.abs()).all(), n
            for n, a, b in zip(one.names, one.master, sharded.master, strict=True):
                bound = LR * (rho + 6 * U) / 4 + 8 * U * LR + 2 * U * a.abs()
                assert ((a - b).abs() <= bound).all(), (n, float((a - b).abs().max()))
        # each rank quantized what it computed with: the one-process codes
        assert ranks[0]["codes"].keys() == ref["codes"].keys()
        if tag.endswith("noclip"):
            assert all(torch.equal(ranks[r]["codes"][k], ref["codes"][k]) for r in (0, 1) for k in ref["codes"])
        if tag.endswith("noclip"):
            ac = torch.load(tmp / f"{arm}_ac.rank0.pt", weights_only=False)
            assert all(torch.equal(ac[n], ranks[0]["grads"][n]) for n in one.names)
        # both ranks received the payload one process ships from the same weights
        assert _same_payload(ranks[0]["payload"], ranks[1]["payload"])
        assert _same_payload(ranks[0]["payload"], sharded.export_weights())


def test_sync_bytes_single_file_checkpoint_and_aligned_logprobs(two_ranks):
    tmp, refs, report = two_ranks
    for arm in ARMS:     # the single-process checkpoint loaded by the two ranks ships the one-process payload
        one = refs[f"{arm}_clip"]["trainer"].export_weights()
        for r in (0, 1):
            assert _same_payload(torch.load(tmp / f"{arm}.from_single.rank{r}.pt", weights_only=False), one)
    bf16, codes = report["bf16_clip"]["sync"], report["minite_nvfp4_clip"]["sync"]
    assert bf16["buckets"] >= 1 and report["naive_te_nvfp4_clip"]["sync"] == bf16
    assert bf16["gathered_bytes"] / codes["gathered_bytes"] > 3.0    # codes + scales instead of BF16
    assert report["bitwise"]


def test_bench_learner_under_torchrun(tmp_path):
    """The user-facing command on two processes: the global batch split, peak memory of every rank, rank 0 writes."""
    import subprocess
    import sys
    out = tmp_path / "learner.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "minite", "bench-learner", "--arm", "minite_nvfp4", "--model", "tiny", "--device", "cpu",
                        "--steps", "1", "--warmup", "1", "--micro-batch-size", "1", "--out", str(out)],
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    j = json.loads(out.read_text())
    assert j["world_size"] == 2 and len(j["peak_mem_gb_per_rank"]) == 2 and j["tokens_per_update"] == 4 * 64
    assert j["weight_quantizations_per_update"] is None and j["tokens_per_s"] > 0
    bad = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "minite", "bench-learner", "--arm", "bf16", "--model", "tiny", "--device", "cpu",
                          "--tokens-per-update", "192", "--out", str(tmp_path / "x.json")],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert bad.returncode != 0 and "3 sequences per update do not split evenly over 2 ranks" in bad.stderr
    assert not (tmp_path / "x.json").exists()
