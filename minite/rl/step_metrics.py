"""Per-step drift measurements beside the mismatch metrics: what is reported to move first before an RL run
collapses (gradient-norm spikes, large |dlogp| on low-probability tokens, router disagreement, response length).

``StepMetrics(cfg, task, ...)`` is built once per run; ``metrics(step, rollout, logp_t, trainer, sampler)`` is
called once per step, after the trainer's recompute and before the update (the weights that sampled the step),
and returns the keys below for the step's JSONL line. They never change the curve: nothing here draws from the
run's generator or touches a weight (the ``metrics`` section of the RL config is not part of the run id).

    response_len_median, response_len_max
                      of the step's sampled responses (tokens, the stop token included; the mean is the loop's
                      ``response_len_mean``); frac_truncated: responses that hit max_new_tokens without a stop
    max_abs_dlogp_p_sampler, max_abs_dlogp_p_trainer
                      the two engines' probabilities of the token with the largest |logp_trainer - logp_sampler|
                      of the step (``max_abs_dlogp``): large gaps are reported on low-probability tokens
    router_disagree   fraction of (token, layer) pairs whose top-k expert SETS differ between trainer and
                      sampler; router_disagree_experts: mean over those pairs of |experts_t \\ experts_s| / k;
                      router_positions: the (token, layer) pairs compared. Measured on ``router_sequences``
                      sequences of the step, spread evenly over the batch (rows round(linspace(0, B-1, n))),
                      every ``router_every`` steps, at the positions whose state predicts a sampled token
                      (``minite.diagnostics.localise.compare_positions``). Trainer: one teacher-forced forward of
                      those sequences with hooks on the routers; sampler: ``sampler.score`` with a top-k capture,
                      ``router_path: prefill`` (one full-sequence forward: cheap; the sampler's own numerics at
                      another batch shape than its decode steps) or ``decode`` (an exact replay of generation,
                      one decode step per token: as costly as the rollout of those sequences).
    heldout_mean_at_k, heldout_pass_at_k, heldout_updates
                      every ``heldout_every`` steps (steps 1, 1 + every, ...): the held-out accuracy of the
                      policy that sampled this step, i.e. after ``heldout_updates`` = step - 1 updates, as the
                      eval job measures a checkpoint (``minite.rl.evaluate.heldout_accuracy``: the ``eval``
                      section's k / n_prompts / temperature / max_new_tokens, a generator seeded by (seed,
                      updates)). For runs too long to keep their checkpoints for the eval job.
    metrics_s         the time all of this took (a timing key)

The gradient norm (before clipping) is the loop's ``grad_norm`` (``Trainer.update``).
"""
from __future__ import annotations

import time

import torch

from minite import distributed as D
from minite.diagnostics.localise import SamplerCapture, attention_mask_for, capture_trainer, compare_positions
from minite.diagnostics.metrics import align_trainer_logprobs
from minite.rl.evaluate import heldout_accuracy


def response_lengths(rollout, max_new_tokens: int, eos_id: int) -> dict:
    """Median / max response length and the fraction of responses cut at max_new_tokens without a stop."""
    lens = rollout.response_lens.float()
    last = rollout.response_mask.shape[1] - 1 - rollout.response_mask.flip(1).long().argmax(1)
    ended = rollout.tokens.gather(1, last[:, None]).squeeze(1) == eos_id
    truncated = (rollout.response_lens >= max_new_tokens) & ~ended
    return {"response_len_median": float(lens.median()), "response_len_max": float(lens.max()),
            "frac_truncated": float(truncated.float().mean())}


def max_dlogp_token(logp_s: torch.Tensor, logp_t: torch.Tensor, mask: torch.Tensor) -> dict:
    """Both engines' probabilities of the token with the largest |logp_t - logp_s| (all [B, T], token positions)."""
    gap = (logp_t.double() - logp_s.double()).abs().masked_fill(~mask.bool(), -1.0)
    i = int(gap.argmax())
    return {"max_abs_dlogp_p_sampler": float(logp_s.flatten()[i].double().exp()),
            "max_abs_dlogp_p_trainer": float(logp_t.flatten()[i].double().exp())}


def topk_disagreement(trainer_topk: dict, sampler_topk: dict, positions: torch.Tensor) -> dict:
    """Top-k expert sets of both engines ({layer: [B, T, k]}) compared at ``positions`` [B, T] of every layer."""
    differ = diff_experts = n = 0
    k = None
    for layer, t in trainer_topk.items():
        s = sampler_topk[layer]
        sel = positions & (s >= 0).all(-1)
        a, b = t[sel], s[sel]
        k = a.shape[-1]
        shared = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1)          # |experts_t & experts_s|
        differ += int((shared < k).sum())
        diff_experts += int((k - shared).sum())
        n += int(sel.sum())
    if n == 0:
        return {}
    return {"router_disagree": differ / n, "router_disagree_experts": diff_experts / (n * k), "router_positions": n}


def router_disagreement(trainer, sampler, tokens, prompt_lens, response_mask, path: str = "prefill") -> dict:
    """``topk_disagreement`` of the two engines on fixed tokens (both engines' routers, hooked / captured)."""
    tokens, response_mask = tokens.cpu(), response_mask.cpu()
    att = attention_mask_for(tokens, prompt_lens, response_mask)
    t_store, _ = capture_trainer(trainer, tokens.to(trainer.device), att.to(trainer.device), ops=("topk",))
    layers = len(trainer.model.model.layers)
    cap = SamplerCapture(tokens.shape[0], tokens.shape[1], layers, ops=("topk",))
    sampler.score(tokens.to(sampler.device), torch.as_tensor(prompt_lens).to(sampler.device), capture=cap, path=path)
    return topk_disagreement({layer: t for (layer, op), t in t_store.items() if op == "topk"},
                             {layer: s for (layer, op), s in cap.data.items()}, compare_positions(response_mask))


class StepMetrics:
    """The per-step measurements of one run (module docstring), configured by the RL config."""

    def __init__(self, cfg: dict, task, *, max_new_tokens: int, max_seq_len: int, max_batch: int, seed: int):
        m, ev = cfg["metrics"], cfg["eval"]
        self.task, self.seed, self.max_new_tokens = task, int(seed), int(max_new_tokens)
        self.router_sequences, self.router_every = int(m["router_sequences"]), int(m["router_every"])
        self.router_path, self.heldout_every, self.ev = m["router_path"], int(m["heldout_every"]), ev
        if self.heldout_every:
            if task.max_prompt_len + ev["max_new_tokens"] > max_seq_len:
                raise ValueError(f"metrics.heldout_every: eval.max_new_tokens ({ev['max_new_tokens']}) must not exceed "
                                 f"rl.max_new_tokens ({max_new_tokens}): the in-run evaluation uses the RL sampler")
            self.problems = task.heldout(ev["n_prompts"])[D.rank()::D.world_size()]   # this rank's share
            self.chunk = max(1, min(len(self.problems), max_batch // int(ev["k"])))

    def __call__(self, step: int, rollout, logp_t: torch.Tensor, trainer, sampler) -> dict:
        t0 = time.perf_counter()
        eos = getattr(self.task, "eos_id", None)
        out = response_lengths(rollout, self.max_new_tokens, eos)
        out.update(max_dlogp_token(rollout.sampler_logprobs, align_trainer_logprobs(logp_t), rollout.response_mask))
        if self.router_sequences and step % self.router_every == 0:
            B = rollout.tokens.shape[0]
            rows = torch.linspace(0, B - 1, min(self.router_sequences, B)).round().long().unique()
            plens = rollout.attention_mask.sum(1) - rollout.response_lens
            width = int((plens[rows] + rollout.response_lens[rows]).max())      # the subset's own width
            out.update(router_disagreement(trainer, sampler, rollout.tokens[rows, :width], plens[rows],
                                           rollout.response_mask[rows, :width], self.router_path))
        if self.heldout_every and (step - 1) % self.heldout_every == 0:
            acc = heldout_accuracy(self.task, sampler, self.problems, self.ev, self.seed, step - 1, self.chunk)
            out.update(heldout_mean_at_k=acc["mean_at_k"], heldout_pass_at_k=acc["pass_at_k"],
                       heldout_updates=step - 1)
        out["metrics_s"] = time.perf_counter() - t0
        return out
