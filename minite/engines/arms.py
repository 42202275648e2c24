"""Arms: plain YAML descriptions of both engines (configs/arms/*.yaml), loaded into frozen dataclasses.

An arm says, for the trainer and for the sampler: precision (bf16 | nvfp4), how weights and activations are
quantized (``QuantSpec``: formula, tile, scaling, and for fused q/k/v and gate/up weights whether the shards
share one global scale or keep their own), which GEMM path runs (bf16 | emulated | kernel | te), which
attention (HF sdpa | minite's batch-invariant one), which non-GEMM numerics (hf | vllm), and which modules
stay in high precision. ``sync`` says what travels after each update: BF16 master weights (the sampler
quantizes them itself) or the trainer's NVFP4 codes + scales (``sampler.weights: from_trainer``). An optional
``rl:`` block fixes RL settings of the arm itself (``Arm.rl``; only ``tis_cap``: how the learner corrects
for the engine mismatch), applied on top of the RL profile by ``minite.rl.config.with_arm_settings``.

Validation is two-layered: a JSON schema (configs/schemas/arm.schema.yaml) for shape and spelling, then
``_check`` for combinations that cannot work. Both raise ``ArmError`` naming the file and the problem. A field
an arm leaves out takes the default of its dataclass field below (``QuantSpec``, ``EngineRecipe``).
``arm.override({"sampler.gemm": "kernel"})`` returns a modified, re-validated copy (used by attribution).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

from minite.yamlconfig import load_yaml, validate

# the shipped arms, in display order: the three of the comparison, the naive arm with truncated importance
# sampling (the correction practitioners apply), and the naive arm's blanket-swap variant (router quantized)
ARMS = ("bf16", "naive_te_nvfp4", "minite_nvfp4", "naive_te_nvfp4_tis", "naive_te_nvfp4_blanket")


class ArmError(ValueError):
    """A malformed, unknown or impossible arm."""


@dataclass(frozen=True)
class QuantSpec:
    formula: str                       # te | vllm | modelopt (minite.nvfp4 formulas)
    tile: tuple[int, int]              # (1, 16) | (16, 16)
    scaling: str                       # tensor | row | static
    fused_shards: str = "per_shard"    # shared: one global scale over fused shards; per_shard: one each

    def quantize_kwargs(self) -> dict:
        return {"formula": self.formula, "tile": self.tile, "scaling": self.scaling}


@dataclass(frozen=True)
class EngineRecipe:
    precision: str                     # bf16 | nvfp4
    gemm: str                          # bf16 | emulated | kernel | te
    attention: str                     # sdpa | invariant
    non_gemm: str                      # hf | vllm
    high_precision: tuple[str, ...]    # embed_tokens, router, lm_head, first_layer, last_layer
    weights: QuantSpec | str | None = None     # QuantSpec, "from_trainer" (sampler only) or None (bf16)
    activations: QuantSpec | None = None
    backward_rounding: str = "nearest"         # trainer gradients: nearest | stochastic
    backward_rht: bool = False
    hp_gemm: str = "bf16"                      # high-precision GEMMs (router, lm_head): bf16 | invariant

    @property
    def is_nvfp4(self) -> bool:
        return self.precision == "nvfp4"

    def keeps_high_precision(self, kind: str, layer: int | None = None, num_layers: int | None = None) -> bool:
        """True if a module of this kind (``names.KINDS``: 'attention', 'experts', 'router', 'lm_head', ...)
        stays BF16."""
        if not self.is_nvfp4 or kind in self.high_precision:
            return True
        if layer is not None and num_layers is not None:
            if "first_layer" in self.high_precision and layer == 0:
                return True
            if "last_layer" in self.high_precision and layer == num_layers - 1:
                return True
        return False


@dataclass(frozen=True)
class Arm:
    name: str
    description: str
    sync: str                          # bf16 | nvfp4_codes
    trainer: EngineRecipe
    sampler: EngineRecipe
    raw: dict | None = None            # the validated YAML, for provenance and overrides
    rl: dict = field(default_factory=dict)   # RL settings the arm fixes (the YAML's `rl:` block, e.g. tis_cap)

    @property
    def needs_calibration(self) -> bool:
        """The sampler quantizes activations with static scales: it must calibrate once, on prompts."""
        act = self.sampler.activations
        return self.sampler.is_nvfp4 and act is not None and act.scaling == "static"

    def override(self, changes: dict[str, object], name: str | None = None) -> "Arm":
        """A copy with dotted-path fields replaced, e.g. {"sampler.activations": {...}}; re-validated."""
        raw = copy.deepcopy(self.raw)
        for path, value in changes.items():
            node = raw
            *parents, leaf = path.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            if value is None:
                node.pop(leaf, None)
            else:
                node[leaf] = copy.deepcopy(value)
        raw["name"] = name or raw["name"]
        return arm_from_dict(raw, source=f"{self.name} + {changes}")


def _quant(d) -> QuantSpec | str | None:
    if d is None or isinstance(d, str):
        return d
    return QuantSpec(**{**d, "tile": tuple(d["tile"])})


def _engine(d: dict) -> EngineRecipe:
    """The YAML's engine block -> EngineRecipe; keys it leaves out take the dataclass defaults."""
    fields = {k: v for k, v in d.items() if k != "backward"}
    fields.update({f"backward_{k}": v for k, v in d.get("backward", {}).items()})  # rounding, rht
    fields["high_precision"] = tuple(d["high_precision"])
    for key in ("weights", "activations"):
        if key in d:
            fields[key] = _quant(d[key])
    return EngineRecipe(**fields)


def _check(arm: Arm) -> None:
    """Combinations that cannot work (the schema checks spelling and shape)."""
    for role in ("trainer", "sampler"):
        e: EngineRecipe = getattr(arm, role)
        if e.is_nvfp4:
            if e.gemm == "bf16":
                raise ArmError(f"{role}: precision nvfp4 needs gemm emulated, kernel or te, not bf16")
            if e.weights is None or e.activations is None:
                raise ArmError(f"{role}: precision nvfp4 needs both weights and activations specs")
        else:
            if e.weights is not None or e.activations is not None or e.gemm != "bf16":
                raise ArmError(f"{role}: precision bf16 takes gemm bf16 and no weights/activations specs")
        if isinstance(e.weights, str) and role == "trainer":
            raise ArmError("trainer.weights cannot be 'from_trainer'")
        if isinstance(e.activations, QuantSpec) and e.activations.tile != (1, 16):
            raise ArmError(f"{role}: activations are quantized in 1x16 blocks along K, not {e.activations.tile}")
        if e.gemm == "te" and role == "sampler":
            raise ArmError("sampler: gemm te is a trainer backend (Transformer Engine)")
        if isinstance(e.activations, QuantSpec) and e.activations.scaling == "static" and role == "trainer":
            raise ArmError("trainer: static activation scales are a serving (sampler) feature")
        for spec in (e.weights, e.activations):
            if isinstance(spec, QuantSpec) and spec.scaling == "row" and spec.tile == (16, 16):
                raise ArmError(f"{role}: row scaling cannot share 16x16 tiles")
    if arm.sync == "nvfp4_codes":
        if not (arm.trainer.is_nvfp4 and arm.sampler.is_nvfp4):
            raise ArmError("sync nvfp4_codes needs both engines in nvfp4")
        if arm.sampler.weights != "from_trainer":
            raise ArmError("sync nvfp4_codes ships the trainer's codes: set sampler.weights: from_trainer")
        if set(arm.trainer.high_precision) != set(arm.sampler.high_precision):
            raise ArmError("sync nvfp4_codes: both engines must keep the same modules in high precision "
                           "(the sampler cannot use codes the trainer never made)")
    elif arm.sampler.weights == "from_trainer":
        raise ArmError("sampler.weights: from_trainer needs sync: nvfp4_codes")


def arm_from_dict(raw: dict, source: str = "<dict>") -> Arm:
    validate(raw, "arm", source, ArmError)
    arm = Arm(name=raw["name"], description=raw.get("description", ""), sync=raw["sync"],
              trainer=_engine(raw["trainer"]), sampler=_engine(raw["sampler"]), raw=raw,
              rl=dict(raw.get("rl", {})))
    try:
        _check(arm)
    except ArmError as e:
        raise ArmError(f"arm {source}: {e}") from None
    return arm


def load_arm(name_or_path: str | Path) -> Arm:
    """Load configs/arms/<name>.yaml, or a YAML file path. Unknown names list the known ones."""
    raw, source = load_yaml("arm", name_or_path, ArmError)
    return arm_from_dict(raw, source=source)
