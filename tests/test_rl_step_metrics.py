"""The per-step drift metrics (minite.rl.step_metrics), the watched-metric alarms (DriftWatch), and the TIS arm
end to end on `tiny`: its RL setting reaches the loss and run.json, and a run with every new metric resumes
with the same curve."""
import json
import math

import pytest
import torch

from minite.engines import build_engines
from minite.engines.arms import load_arm
from minite.engines.models import load_model_config
from minite.rl import stability
from minite.rl.checkpoints import checkpoints
from minite.rl.config import RLConfigError, load_rl_config, with_arm_settings
from minite.rl.drift import DriftWatch
from minite.rl.rollout import Rollout
from minite.rl.spec import RunSpec
from minite.rl.stability import is_timing_key, run_stability
from minite.rl.step_metrics import max_dlogp_token, response_lengths, router_disagreement, topk_disagreement
from minite.tasks import build_task
from minite.tokenizer import EOS

SMALL = {"sft.steps": 3, "sft.batch_size": 8, "sft.eval_prompts": 8, "rl.prompts_per_step": 2,
         "rl.group_size": 2, "rl.max_new_tokens": 4, "eval.k": 2, "eval.n_prompts": 3, "eval.max_new_tokens": 4,
         "drift.warmup": 3, "collapse.warmup": 3, "metrics.heldout_every": 2,
         "metrics.watch": {"grad_norm": 1e-8, "max_abs_dlogp": 1e-6, "router_disagree": 1e-3}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    from minite.rl.sft import run_sft
    cfg = load_rl_config("cpu", SMALL)
    task, model = build_task(cfg["task"], seed=0), load_model_config("tiny")
    sft_dir = tmp_path_factory.mktemp("sft")
    run_sft(model, cfg, task, sft_dir, progress=False)
    return cfg, task, model, sft_dir


def test_topk_disagreement_counts_sets_and_experts():
    t = {0: torch.tensor([[[0, 1], [2, 3], [4, 5]]]), 1: torch.tensor([[[0, 1], [2, 3], [4, 5]]])}
    s = {0: torch.tensor([[[1, 0], [2, 7], [4, 5]]]), 1: torch.tensor([[[6, 7], [3, 2], [-1, -1]]])}
    pos = torch.tensor([[True, True, True]])
    d = topk_disagreement(t, s, pos)
    # layer 0: order ignored, one set differs by one expert; layer 1: one differs by both, the last not captured
    assert d["router_positions"] == 5
    assert d["router_disagree"] == pytest.approx(2 / 5) and d["router_disagree_experts"] == pytest.approx(3 / 10)
    assert topk_disagreement(t, t, torch.zeros(1, 3, dtype=torch.bool)) == {}


def test_response_lengths_and_the_max_dlogp_token():
    tokens = torch.tensor([[1, 4, 5, EOS, 0], [1, 4, 5, 6, 7], [1, 4, EOS, 0, 0]])
    resp = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    ro = Rollout(tokens, (tokens > 0).long(), resp, torch.zeros(3, 5), torch.zeros(3), resp.sum(1))
    assert response_lengths(ro, max_new_tokens=4, eos_id=EOS) == {
        "response_len_median": 3.0, "response_len_max": 4.0, "frac_truncated": pytest.approx(1 / 3)}
    ls = torch.log(torch.tensor([[1, .5, .5, .5, 1], [1, .5, .02, .5, .5], [1, .5, .5, 1, 1]]))
    lt = torch.log(torch.tensor([[1, .5, .4, .5, 1], [1, .5, .04, .5, .5], [1, .5, .5, 1e-9, 1]]))
    d = max_dlogp_token(ls, lt, resp)                        # |dlogp|: 0.22 and log 2 = 0.69; off-mask ignored
    assert d["max_abs_dlogp_p_sampler"] == pytest.approx(0.02) and d["max_abs_dlogp_p_trainer"] == pytest.approx(0.04)


def test_router_disagreement_on_engines(setup):
    """Aligned engines agree on every expert set, through the prefill and the decode path; a sampler whose
    router weights are perturbed does not."""
    _, task, model, sft_dir = setup
    from minite.rl.spec import init_weights_path
    prompts = task.heldout_prompts(4)
    out = {}
    for name in ("minite_nvfp4", "bf16"):
        tr, sa = build_engines(load_arm(name), model, checkpoint=str(init_weights_path(sft_dir)), max_batch=4,
                               max_seq_len=32)
        g = sa.generate(prompts, 6, generator=torch.Generator().manual_seed(0))
        out[name] = (tr, sa, g)
    tr, sa, g = out["minite_nvfp4"]
    for path in ("prefill", "decode"):
        d = router_disagreement(tr, sa, g.tokens, g.prompt_lens, g.response_mask, path)
        assert d["router_disagree"] == 0.0 and d["router_positions"] == 2 * int(g.response_mask.sum())
    tr, sa, g = out["bf16"]
    for lw in sa.weights.layers:
        lw.router.weight += torch.randn_like(lw.router.weight.float()).to(lw.router.weight.dtype) * 0.5
    d = router_disagreement(tr, sa, g.tokens, g.prompt_lens, g.response_mask, "prefill")
    assert 0 < d["router_disagree"] <= 1 and 0 < d["router_disagree_experts"] <= d["router_disagree"]


def test_drift_watch_floors_gaps_and_state():
    w = DriftWatch({"router_disagree": 1e-3, "grad_norm": 1e-8}, warmup=3, kappa=1.0, h=8.0, sigma_floor=0.05)
    for step in range(1, 9):
        rec = {"grad_norm": 1.0 + 0.01 * (step % 2)}
        if step % 2:
            rec["router_disagree"] = 0.0 if step < 7 else 2e-4      # under the floor: no shift at all
        r = w.update(step, rec)
        assert set(r["watch"]) == set(rec)                          # a metric not measured this step is skipped
    assert w.alarm_steps() == {"router_disagree": None, "grad_norm": None}
    again = DriftWatch({"router_disagree": 1e-3, "grad_norm": 1e-8}, warmup=3)
    again.load_state_dict(json.loads(json.dumps(w.state_dict())))
    for step in range(9, 14):                                        # grad_norm x 100: a sustained spike
        w.update(step, {"grad_norm": 100.0})
        again.update(step, {"grad_norm": 100.0})
    assert w.alarm_steps()["grad_norm"] == again.alarm_steps()["grad_norm"] is not None
    assert DriftWatch({}).update(1, {"grad_norm": 1.0}) == {}


def test_arm_rl_settings_apply_on_top_of_the_profile():
    cfg = load_rl_config("cpu")
    tis = load_arm("naive_te_nvfp4_tis")
    got = with_arm_settings(cfg, tis)
    assert got["rl"]["tis_cap"] == 2.0 and got["_arm_rl"] == {"tis_cap": 2.0} and cfg["rl"]["tis_cap"] is None
    assert with_arm_settings(got, tis) == got and with_arm_settings(cfg, load_arm("naive_te_nvfp4")) is cfg
    assert with_arm_settings(load_rl_config("cpu", {"rl.tis_cap": 2.0}), tis)["rl"]["tis_cap"] == 2.0
    with pytest.raises(RLConfigError, match="arm naive_te_nvfp4_tis sets rl.tis_cap=2.0"):
        with_arm_settings(load_rl_config("cpu", {"rl.tis_cap": 3.0}), tis)


class Kill(RuntimeError):
    pass


def test_tis_arm_with_every_metric_resumes_with_the_same_curve(setup, tmp_path, monkeypatch):
    cfg, task, model, sft_dir = setup
    arm = load_arm("naive_te_nvfp4_tis")
    spec = RunSpec(arm, model, cfg, task, init=sft_dir)
    assert spec.cfg["rl"]["tis_cap"] == 2.0 and RunSpec(load_arm("naive_te_nvfp4"), model, cfg, task).run_id() \
        != spec.run_id()
    full = run_stability(spec, tmp_path / "full", 4, ckpt_every=2, progress=False)

    def kill(step):
        if step == 4:
            raise Kill
    with monkeypatch.context() as m, pytest.raises(Kill):
        m.setattr(stability, "_after_step", kill)
        run_stability(spec, tmp_path / "cut", 4, ckpt_every=2, progress=False)
    assert [s for s, _ in checkpoints(tmp_path / "cut")] == [2]
    cut = run_stability(spec, tmp_path / "cut", 4, ckpt_every=2, progress=False)

    def lines(d):
        return [json.loads(x) for x in (d / "stability.jsonl").read_text().splitlines()]
    a, b = lines(tmp_path / "full"), lines(tmp_path / "cut")
    strip = lambda r: {k: v for k, v in r.items() if not is_timing_key(k)}  # noqa: E731
    assert [strip(r) for r in a] == [strip(r) for r in b]             # the new metrics resume exactly too
    assert full["alarms"] == cut["alarms"] and set(full["alarms"]) == {"k3", "grad_norm", "max_abs_dlogp",
                                                                     "router_disagree"}
    for r in a:
        assert 0 < r["tis_weight_mean"] <= 2.0 and r["grad_norm"] >= 0 and "watch" in r
        for key in ("router_disagree", "router_positions", "max_abs_dlogp_p_sampler", "max_abs_dlogp_p_trainer",
                    "response_len_median", "response_len_max", "frac_truncated", "metrics_s"):
            assert key in r, key
        assert 0 <= r["max_abs_dlogp_p_sampler"] <= 1 and math.isfinite(r["max_abs_dlogp_p_trainer"])
    assert [r.get("heldout_updates") for r in a] == [0, None, 2, None]     # every 2 steps, from the warm start
    assert 0 <= a[0]["heldout_mean_at_k"] <= a[0]["heldout_pass_at_k"] <= 1
    run = json.loads((tmp_path / "cut" / "run.json").read_text())
    assert run["config"]["rl"]["tis_cap"] == 2.0 and run["config"]["_arm_rl"] == {"tis_cap": 2.0}
    # the measurements are not part of the run's identity: turning one off resumes the same run
    off = load_rl_config("cpu", {**SMALL, "metrics.router_sequences": 0})
    assert RunSpec(arm, model, off, task, init=sft_dir).run_id() == spec.run_id()


def test_in_run_evaluation_must_fit_the_rl_sampler(setup):
    cfg, task, model, sft_dir = setup
    bad = load_rl_config("cpu", {**SMALL, "eval.max_new_tokens": 16})
    with pytest.raises(ValueError, match="eval.max_new_tokens"):
        run_stability(RunSpec(load_arm("bf16"), model, bad, task, init=sft_dir), "/nonexistent/never", 1,
                      progress=False)
