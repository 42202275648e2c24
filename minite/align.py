"""Cross-engine alignment: apply the ``minite_nvfp4`` contract to a trainer/sampler pair, and verify it.

The contract (configs/arms/minite_nvfp4.yaml) — what makes the sampler compute the trainer's numbers:
    * both engines NVFP4; the trainer quantizes its weights once per update and ships the codes + scales
      (``sync: nvfp4_codes``); the sampler uses them bit for bit (``sampler.weights: from_trainer``);
    * the same activation quantizer in both engines, per token (``scaling: row``), so a token's codes do
      not depend on its batch;
    * the same batch-invariant W4A4 GEMM (``gemm: kernel``), the same batch-invariant attention
      (``attention: invariant``) and the same non-GEMM ops (``non_gemm: hf``) in both engines;
    * the same high-precision exceptions in both engines.

``align(trainer, sampler)`` checks the pair. What cannot be aligned is refused with ``AlignmentError``
(an ``ArmError``) naming every reason: a BF16 trainer (no codes to share), a Transformer Engine trainer
(``gemm: te``: its codes are not exported), different high-precision sets (the sampler would need codes
for modules the trainer keeps in BF16, or would serve a different model), and a trainer not built for the
contract (its modules are fixed at construction: rebuild it with ``contract_arm(arm)``). A sampler built
for another recipe is replaced by a new one built for the contract (returned in the report). Then the
trainer's codes are synced and ``verify_alignment`` runs: every synced NVFP4 weight compared bitwise
(codes, E4M3 block scales, global scales) with what the sampler holds, and a probe batch scored by both
engines must give a mismatch k3 within ``budget_k3`` (default 0: the contract promises identical bits).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minite import nvfp4
from minite.engines.arms import Arm, ArmError, load_arm

CONTRACT_ARM = "minite_nvfp4"


class AlignmentError(ArmError):
    """A trainer/sampler pair that cannot be aligned, or that failed verification."""


@dataclass
class AlignmentReport:
    arm: str
    ok: bool
    codes_identical: bool
    weights_checked: int
    mismatched: list[str] = field(default_factory=list)
    probe: dict | None = None           # mismatch metrics of the probe batch
    budget_k3: float = 0.0
    sampler_rebuilt: list[str] = field(default_factory=list)   # contract fields the old sampler violated
    sampler: object = None              # the (possibly new) aligned sampler

    def summary(self) -> dict:
        return {"arm": self.arm, "ok": self.ok, "codes_identical": self.codes_identical,
                "weights_checked": self.weights_checked, "mismatched": self.mismatched,
                "probe_k3": None if self.probe is None else self.probe["k3"], "budget_k3": self.budget_k3,
                "sampler_rebuilt": self.sampler_rebuilt}


def _contract() -> Arm:
    return load_arm(CONTRACT_ARM)


def blockers(arm: Arm) -> list[str]:
    """Why ``arm``'s engines can never be aligned under the contract (empty if they can)."""
    out = []
    if not arm.trainer.is_nvfp4:
        out.append("the trainer runs in BF16: there are no NVFP4 codes to share (the bf16 arm has no "
                   "quantizer to align; its gap is the BF16 engines' own)")
    if arm.trainer.gemm == "te":
        out.append("trainer gemm 'te': Transformer Engine's NVFP4 weight codes are internal to TE and not "
                   "exported, so the sampler cannot use them (use gemm 'kernel')")
    if set(arm.trainer.high_precision) != set(arm.sampler.high_precision):
        only_t = sorted(set(arm.trainer.high_precision) - set(arm.sampler.high_precision))
        only_s = sorted(set(arm.sampler.high_precision) - set(arm.trainer.high_precision))
        out.append(f"different high-precision sets (trainer only: {only_t}, sampler only: {only_s}): the "
                   "sampler would need codes the trainer never makes, or would serve another model; make "
                   "both lists equal")
    return out


def contract_arm(arm: Arm, name: str | None = None) -> Arm:
    """``arm`` with the contract applied (the trainer's weight recipe and high-precision set kept)."""
    problems = blockers(arm)
    if problems:
        raise AlignmentError(f"arm {arm.name} cannot be aligned: " + "; ".join(problems))
    c = _contract().raw
    ch = {"sync": "nvfp4_codes", "sampler.weights": "from_trainer", "sampler.precision": "nvfp4"}
    for role in ("trainer", "sampler"):
        for key in ("activations", "gemm", "attention", "non_gemm"):
            ch[f"{role}.{key}"] = c[role][key]
    return arm.override(ch, name=name or f"{arm.name}_aligned".replace("-", "_"))


def _recipe_diff(have: Arm, want: Arm, role: str) -> list[str]:
    a, b = getattr(have, role), getattr(want, role)
    diffs = [f"{role}.{k}: {getattr(a, k)!r} -> {getattr(b, k)!r}"
             for k in ("precision", "weights", "activations", "gemm", "attention", "non_gemm")
             if getattr(a, k) != getattr(b, k)]
    if set(a.high_precision) != set(b.high_precision):
        diffs.append(f"{role}.high_precision: {sorted(a.high_precision)} -> {sorted(b.high_precision)}")
    if role == "sampler" and have.sync != want.sync:
        diffs.append(f"sync: {have.sync!r} -> {want.sync!r}")
    return diffs


def align(trainer, sampler, probe_tokens=None, prompt_lens=None, response_mask=None, budget_k3: float = 0.0,
          strict: bool = True, **probe_kw) -> AlignmentReport:
    """Apply the contract to the pair (module docstring), sync the trainer's codes, verify. Returns the
    report (``report.sampler`` is the aligned sampler); raises ``AlignmentError`` when the pair cannot be
    aligned, or (``strict``) when verification fails. ``probe_kw``: n_probe, max_new_tokens, seed of the
    generated probe batch (``verify_alignment``)."""
    problems = blockers(trainer.arm)
    hp_t, hp_s = set(trainer.arm.trainer.high_precision), set(sampler.arm.sampler.high_precision)
    if hp_t != hp_s and not any(p.startswith("different high-precision") for p in problems):
        problems.append(f"different high-precision sets (trainer: {sorted(hp_t)}, sampler: {sorted(hp_s)}): "
                        "the sampler would need codes the trainer never makes, or would serve another model")
    if problems:
        raise AlignmentError(f"trainer/sampler pair ({trainer.arm.name}, {sampler.arm.name}) cannot be aligned: "
                             + "; ".join(problems))
    want = contract_arm(trainer.arm)
    t_diff = _recipe_diff(trainer.arm, want, "trainer")
    if t_diff or trainer.arm.sync != "nvfp4_codes":
        raise AlignmentError(f"the trainer was built for arm {trainer.arm.name}, not for the contract "
                             f"({'; '.join(t_diff) or 'sync -> nvfp4_codes'}); its modules are fixed at "
                             "construction: build it with minite.align.contract_arm(arm)")
    s_diff = _recipe_diff(sampler.arm, want, "sampler")
    if s_diff:  # the sampler is cheap to rebuild: a new one for the contract recipe
        from minite.engines.sampler import Sampler
        sampler = Sampler(want, sampler.model_cfg, device=sampler.device, max_batch=sampler.max_batch,
                          max_seq_len=sampler.max_seq_len)
    from minite.engines.sync import sync_weights
    sync_weights(trainer, sampler)
    rep = verify_alignment(trainer, sampler, probe_tokens, prompt_lens, response_mask, budget_k3, **probe_kw)
    rep.sampler_rebuilt, rep.sampler = s_diff, sampler
    if strict and not rep.ok:
        raise AlignmentError(f"alignment of arm {want.name} failed verification: {rep.summary()}")
    return rep


# ------------------------------------------------------------------------------------------ verification
def _same(a: nvfp4.NVFP4Tensor, b: nvfp4.NVFP4Tensor) -> bool:
    if a.codes.shape != b.codes.shape:
        return False
    return (torch.equal(a.codes.cpu(), b.codes.cpu())
            and torch.equal(a.scales.cpu().view(torch.uint8), b.scales.cpu().view(torch.uint8))
            and torch.equal(a.row_global_scale().cpu(), b.row_global_scale().cpu()))


def sampler_nvfp4_weights(sampler) -> dict[str, nvfp4.NVFP4Tensor | list]:
    """The sampler's quantized weights under the trainer's (HF) parameter names: fused QKV split back into
    q/k/v rows; experts as lists of E tensors (gate/up fused per expert, as the trainer exports them)."""
    w = sampler.weights
    if w is None:
        raise AlignmentError("the sampler holds no weights (sync first)")
    out = {}
    for lin in w.linears():
        if lin.quantized:
            out.update(lin.shards())
    for lw in w.layers:
        if lw.experts is not None and lw.experts.quantized:
            out.update({name: list(v) for name, v in lw.experts.shards().items()})
    return out


def compare_codes(trainer, sampler) -> tuple[int, list[str]]:
    """(weights checked, names that differ or exist on one side only), every NVFP4 weight bitwise."""
    payload = trainer.export_weights()
    if payload["form"] != "nvfp4_codes":
        raise AlignmentError(f"trainer exports {payload['form']!r} weights, not NVFP4 codes")
    ours = {k: v for k, v in payload["tensors"].items()
            if isinstance(v, nvfp4.NVFP4Tensor) or (isinstance(v, list) and v and isinstance(v[0], nvfp4.NVFP4Tensor))}
    theirs = sampler_nvfp4_weights(sampler)
    bad = [f"{k} (sampler keeps it in BF16)" for k in sorted(set(ours) - set(theirs))]
    bad += [f"{k} (trainer keeps it in BF16)" for k in sorted(set(theirs) - set(ours))]
    n = 0
    for k in sorted(set(ours) & set(theirs)):
        a, b = ours[k], theirs[k]
        pairs = list(zip(a, b)) if isinstance(a, list) else [(a, b)]
        n += len(pairs)
        if (isinstance(a, list) and len(a) != len(b)) or not all(_same(x, y) for x, y in pairs):
            bad.append(k)
    return n, bad


def verify_alignment(trainer, sampler, probe_tokens=None, prompt_lens=None, response_mask=None,
                     budget_k3: float = 0.0, n_probe: int = 4, max_new_tokens: int = 8, seed: int = 0
                     ) -> AlignmentReport:
    """Codes identical (bitwise, every synced NVFP4 weight) and the probe batch's k3 <= ``budget_k3``.
    Without ``probe_tokens`` the sampler generates a probe batch from ``n_probe`` prompts (seeded)."""
    from minite.diagnostics.run import measure, sample
    from minite.tasks import task_for_model

    n, bad = compare_codes(trainer, sampler)
    if probe_tokens is None:
        prompts = task_for_model(None, trainer.model_cfg, seed).heldout_prompts(n_probe)
        out = sample(sampler, prompts, max_new_tokens, seed)
        probe_tokens, prompt_lens, response_mask = out.tokens, out.prompt_lens, out.response_mask
    elif prompt_lens is None or response_mask is None:
        raise ValueError("probe_tokens need prompt_lens and response_mask")
    m = measure(trainer, sampler, probe_tokens, prompt_lens, response_mask)
    ok = not bad and n > 0 and m["k3"] <= budget_k3
    return AlignmentReport(arm=sampler.arm.name, ok=ok, codes_identical=not bad and n > 0, weights_checked=n,
                           mismatched=bad, probe=m, budget_k3=budget_k3, sampler=sampler)
