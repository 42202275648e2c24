"""The training engine: upstream ``transformers.Qwen3MoeForCausalLM`` with arm-specific modules.

What the arm's ``trainer`` recipe changes, and how (all through public modules / extension points):
    q/k/v/o projections (and lm_head unless high precision)  -> ``quant_linear.NVFP4Linear`` (same Parameter)
    router (``Qwen3MoeTopKRouter``) unless high precision     -> an HF-router subclass with an NVFP4 GEMM
    experts (3D params)       -> transformers' ``ExpertsInterface``: "grouped_mm" (BF16) or "minite_nvfp4"
    attention                 -> transformers' ``AttentionInterface``: SDPA or minite's invariant attention,
                                 registered for the trainer without a mask function (it passes its own masks)
    embeddings, norms, rotary, SiLU, softmax: upstream HF ops, BF16.
Layers in ``first_layer`` / ``last_layer`` keep all their GEMMs in BF16 when the arm lists them.

Precision: the model holds BF16 weights and computes in BF16; the optimizer (AdamW) holds fp32 master
weights and fp32 state. Micro-batch gradients are accumulated in fp32 on the masters; after the step the
masters are copied (rounded) into the BF16 model and the NVFP4 weight cache is invalidated.

Several processes (torchrun, ``minite.distributed``): the model is sharded with FSDP2 (``fsdp.py``: one
``fully_shard`` per decoder layer and the root); the sharded fp32 parameters are the masters, FSDP gathers
them as the same BF16 weights, and every rank updates on its own rows of the batch, normalised by the loss
tokens of all ranks. Weight sync gathers layer by layer in buckets (``sharded_sync.py``).
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from minite import distributed as D
from minite.engines import experts as X
from minite.engines import quant_linear as Q
from minite.engines.arms import Arm, load_arm
from minite.engines.attention import causal_keep_mask, register_trainer_attention
from minite.engines.models import build_hf_config, build_hf_model, load_model_config
from minite.engines.names import is_quantized, param_kind
from minite.provenance import atomic_path


def default_loss(logprobs: torch.Tensor, batch: dict) -> torch.Tensor:
    """Summed NLL of the slice's loss tokens (``Trainer.update`` divides by the batch's loss-token count)."""
    m = batch["loss_mask"][:, 1:].to(logprobs.dtype)
    return -(logprobs * m).sum()


class Trainer:
    def __init__(self, arm: Arm | str, model_cfg: dict | str, device: str = "cpu", seed: int = 0,
                 lr: float = 1e-4, micro_batch_size: int | None = None, checkpoint: str | None = None,
                 weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8, grad_clip: float | None = 1.0,
                 weight_cache: str | None = None, compute_dtype: str = "bfloat16", shard: bool | None = None,
                 activation_checkpointing: bool = False):
        self.arm = load_arm(arm) if isinstance(arm, str) else arm
        self.model_cfg = load_model_config(model_cfg)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device cuda requested but no CUDA GPU is available")
        r = self.arm.trainer
        if r.non_gemm != "hf":
            raise ValueError(f"trainer non_gemm {r.non_gemm!r}: the trainer runs upstream HF ops only ('hf')")
        if r.gemm == "te":
            from minite.engines.te_backend import require_te
            require_te()
        self.seed, self.micro_batch_size, self.grad_clip = seed, micro_batch_size, grad_clip
        self.rounding_seed = seed       # stochastic rounding's streams (``_seed_rounding``); checkpointed
        attn = register_trainer_attention(r.attention)
        experts_impl = X.register_experts() if r.is_nvfp4 else "grouped_mm"
        self.hf_config = build_hf_config(self.model_cfg, attn_implementation=attn,
                                         experts_implementation=experts_impl)
        self.model = build_hf_model(self.model_cfg, self.hf_config, seed=seed, checkpoint=checkpoint,
                                    device=self.device)
        # minite arm: weights quantized once per update (the codes the sampler gets); naive: every forward,
        # as te.Linear does by default. ``weight_cache`` overrides: "per_update" is what TE does when the
        # caller passes is_first_microbatch (Megatron), a fairer throughput baseline with micro-batching.
        if weight_cache not in (None, "per_update", "per_forward"):
            raise ValueError(f"weight_cache must be per_update or per_forward, not {weight_cache!r}")
        if weight_cache == "per_forward" and self.arm.sync == "nvfp4_codes":
            raise ValueError("sync nvfp4_codes ships the codes of one update: it needs weight_cache per_update")
        per_update = (weight_cache or ("per_update" if self.arm.sync == "nvfp4_codes" else "per_forward")) \
            == "per_update"
        self.qstate = Q.QuantState(r, cache_per_update=per_update, seed=seed)
        self.qstate.cuda = self.device.type == "cuda"
        if r.is_nvfp4:
            self._swap_modules()
        if r.hp_gemm == "invariant":
            self._invariant_hp_modules()
        self.model.to(self.device)
        if compute_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"compute_dtype must be bfloat16 or float32, not {compute_dtype!r}")
        if compute_dtype == "float32":
            # the BF16 weights widened, the model computes in fp32 (CPUs without fast bf16 GEMMs); the masters
            # and the optimizer state are fp32 either way
            self.model.float()
        if activation_checkpointing:
            # each decoder layer's forward is recomputed in backward instead of keeping its activations (and
            # the dequantized NVFP4 weights its GEMMs saved): the same numbers, less memory
            enable = getattr(self.model, "activation_checkpointing_enable", None)   # transformers >= 5.2x
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._compute_fp32 = compute_dtype == "float32"
        self.sharded = D.active() if shard is None else bool(shard)
        if self.sharded:
            if not D.active():
                raise RuntimeError("shard=True needs a process group of several processes (launch with torchrun)")
            from minite.engines import fsdp
            fsdp.shard_model(self.model, self.device, getattr(torch, compute_dtype))
        self.names = [n for n, _ in self.model.named_parameters()]
        self.params = [p for _, p in self.model.named_parameters()]
        # sharded: the fp32 shards are the masters (FSDP gathers them in the compute dtype)
        self.master = self.params if self.sharded else [p.detach().float().clone() for p in self.params]
        kw = {"fused": True} if self.device.type == "cuda" else {"foreach": True}
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                           **kw)
        self.update_count = 0
        self.last_export = None     # sharded: the last sync's buckets and bytes gathered

    # ---------------------------------------------------------------------------------------- building
    def _param_names(self) -> list[str]:
        """Every parameter name, a tied lm_head included (it is a module of its own)."""
        return [n for n, _ in self.model.named_parameters(remove_duplicate=False)]

    def _swap_modules(self) -> None:
        """The module of every parameter the trainer quantizes (``names.is_quantized``) -> its NVFP4 form."""
        r, st = self.arm.trainer, self.qstate
        n = len(self.model.model.layers)
        router_cls = None
        for pname in self._param_names():
            kind, layer = param_kind(pname)
            if kind == "mlp":
                raise RuntimeError(f"layer {layer}: expected a Qwen3MoeSparseMoeBlock (dense MLP layers unsupported)")
            if not is_quantized(r, pname, n):
                continue
            mname = pname.rpartition(".")[0]
            mod = self.model.get_submodule(mname)
            if kind == "experts":  # one ExpertsQuant for the module's two 3D parameters
                if getattr(mod, "minite_quant", None) is None:
                    mod.minite_quant = X.ExpertsQuant(st)
            elif kind == "router":
                router_cls = router_cls or Q.make_router(type(mod))
                new = router_cls(self.hf_config)
                new.weight = mod.weight
                self.model.set_submodule(mname, new.attach(st))
            else:  # attention projections, lm_head
                if kind == "lm_head" and self.model_cfg.get("tie_word_embeddings"):
                    raise ValueError("an NVFP4 lm_head with tied embeddings is not supported; keep lm_head BF16")
                self.model.set_submodule(mname, self._linear(mod))

    def _invariant_hp_modules(self) -> None:
        """High-precision router / lm_head: batch-invariant BF16 GEMMs on log-prob paths (arm hp_gemm)."""
        r = self.arm.trainer
        n = len(self.model.model.layers)
        router_cls = None
        for pname in self._param_names():
            kind, _ = param_kind(pname)
            if kind not in ("router", "lm_head") or is_quantized(r, pname, n):
                continue
            mname = pname.rpartition(".")[0]
            mod = self.model.get_submodule(mname)
            if kind == "router":
                router_cls = router_cls or Q.make_invariant_router(type(mod))
                new = router_cls(self.hf_config)
                new.weight = mod.weight
                self.model.set_submodule(mname, new)
            elif type(mod) is torch.nn.Linear:
                self.model.set_submodule(mname, Q.InvariantLinear.from_linear(mod))

    def _linear(self, lin):
        if self.arm.trainer.gemm == "te":
            from minite.engines.te_backend import te_linear
            return te_linear(lin)
        return Q.NVFP4Linear.from_linear(lin, self.qstate)

    # ------------------------------------------------------------------------------------------ compute
    def _token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Log-probs of tokens 1..T-1. ``attention_mask`` None = no padding (causal attention), else the [B, T]
        padding mask, passed on as a 4D keep mask (``register_trainer_attention``: no host sync per forward)."""
        ctx = contextlib.nullcontext()
        if self.arm.trainer.gemm == "te":
            from minite.engines import te_backend
            ctx = te_backend.autocast()
        keep = causal_keep_mask(attention_mask) if attention_mask is not None else None
        with ctx:
            logits = self.model(input_ids=input_ids, attention_mask=keep, use_cache=False).logits
        logits = logits[:, :-1].float()
        targets = input_ids[:, 1:]
        lp = -torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                reduction="none")
        return lp.view(targets.shape)

    def _batch(self, batch: dict) -> dict:
        ids = batch["input_ids"]
        if ids.dim() != 2 or ids.dtype != torch.long:
            raise ValueError(f"input_ids must be a long [B, T] tensor, got {ids.dtype} {tuple(ids.shape)}")
        if int(ids.max()) >= self.model_cfg["vocab_size"] or int(ids.min()) < 0:
            raise ValueError(f"input_ids outside the vocabulary 0..{self.model_cfg['vocab_size'] - 1}")
        out = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        out.setdefault("attention_mask", torch.ones_like(out["input_ids"]))
        out.setdefault("loss_mask", out["attention_mask"])
        return out

    def _chunks(self, b: int):
        mbs = self.micro_batch_size or b
        return [slice(s, min(s + mbs, b)) for s in range(0, b, mbs)]

    def update(self, batch: dict, loss_fn=None) -> dict:
        """One complete learner update (forward, backward, AdamW step). See docs/ENGINES.md.

        The loss contract: ``loss_fn(logprobs, batch_slice)`` returns the SUM of the per-token losses over the
        loss tokens of its micro-batch slice (``micro_batch_size`` sequences); the trainer divides every slice's
        sum by the number of loss tokens of the whole batch (``loss_mask[:, 1:]``), so the objective is a
        token mean whatever the slicing (with data parallelism, that count is the all-ranks total). A loss that
        weights tokens unevenly (a per-sequence mean) folds the weights into its per-token losses; the slice
        carries the whole batch's counts for that: ``_n_tokens`` (loss tokens) and ``_n_sequences`` (rows).
        The default loss is the NLL (masked mean NLL of the batch). Raises FloatingPointError (no step taken)
        when the gradient norm is NaN/Inf."""
        cuda = self.device.type == "cuda"
        r_nvfp4 = self.arm.trainer.is_nvfp4
        t_start = time.perf_counter()
        self.qstate.collect()  # drop anything timed outside updates (logprobs, export)
        batch = self._batch(batch)
        b = batch["input_ids"].shape[0]
        chunks = self._chunks(b)
        n_loss = int(batch["loss_mask"][:, 1:].sum())
        n_seen = int(batch["attention_mask"].sum())
        padded = n_seen < batch["attention_mask"].numel()
        if self.sharded:   # this rank's rows; the loss is normalised by the loss tokens of every rank
            from minite.engines import fsdp
            n_loss, b_all, row0, n_seen = fsdp.batch_layout(b, n_loss, n_seen, len(chunks))
        else:
            b_all, row0 = b, 0
        n_tokens = max(n_loss, 1)
        loss_fn = loss_fn or default_loss
        self.model.train()
        for m in self.master:
            if self.sharded:
                m.grad = None     # FSDP writes the first reduce-scattered gradient, then accumulates
            else:
                m.grad = torch.zeros_like(m) if m.grad is None else m.grad.zero_()
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # summed on the device: no sync per slice
        for sl in chunks:
            sub = {k: (v[sl] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b else v)
                   for k, v in batch.items()}
            sub["_n_tokens"], sub["_n_sequences"] = n_tokens, b_all
            self._seed_rounding(row0 + sl.start)
            lp = self._token_logprobs(sub["input_ids"], sub["attention_mask"] if padded else None)
            loss = loss_fn(lp, sub) / n_tokens
            loss.backward()
            total += loss.detach().double()
            if not self.sharded:
                for p, m in zip(self.params, self.master, strict=True):
                    if p.grad is not None:
                        m.grad.add_(p.grad)  # fp32 += bf16, promoted in place (no fp32 temporary)
                        p.grad = None
        total = float(total)
        if self.sharded:
            total = float(D.all_reduce([total])[0])
        if cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
        t_opt = time.perf_counter()
        clip = self.grad_clip if self.grad_clip is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.master, clip, foreach=True)
        grad_norm = float(norm.full_tensor() if self.sharded else norm)
        if not torch.isfinite(torch.tensor(grad_norm)):
            raise FloatingPointError(f"update {self.update_count}: gradient norm is {grad_norm} "
                                     "(NaN/Inf); the optimizer step was not taken")
        self.optimizer.step()
        if not self.sharded:
            with torch.no_grad():
                # fp32 master -> BF16 model (round to nearest)
                for p, m in zip(self.params, self.master, strict=True):
                    p.copy_(m)
        self.qstate.bump()
        self.update_count += 1
        if cuda:
            ev[1].record()
            torch.cuda.synchronize()
            opt_s = ev[0].elapsed_time(ev[1]) / 1e3
        else:
            opt_s = time.perf_counter() - t_opt
        spent = self.qstate.collect()
        total_s = time.perf_counter() - t_start
        if self.qstate.split_timing:
            quant_s = spent.get("quantize", 0.0)
            gemm_s = spent.get("gemm") if r_nvfp4 else None   # BF16 GEMMs inside HF modules are not separated
            other_s = total_s - opt_s - quant_s - (gemm_s or 0.0)
        else:    # not timed (``QuantState.split_timing``): forward and backward as one figure
            quant_s = gemm_s = None
            other_s = total_s - opt_s
        return {"loss": total, "grad_norm": grad_norm, "tokens": n_seen,
                "time_s": total_s,
                "times": {"quantize": quant_s, "gemm": gemm_s, "other": other_s, "optimizer": opt_s},
                "weight_quantizations": self.qstate.weight_quantizations,
                "act_quantizations": self.qstate.act_quantizations}

    def _seed_rounding(self, row: int) -> None:
        """Stochastic rounding of gradients draws from a stream started afresh for every micro-batch, at a
        seed fixed by (trainer seed, update, the micro-batch's first row in the whole batch): the same rows
        get the same rounding noise however the batch is split over ranks."""
        key = (self.rounding_seed * 1_000_003 + self.update_count) * 1_000_003 + row
        self.qstate.generator.manual_seed(key % (2 ** 63 - 1))

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced log-probs [B, T-1] fp32 of tokens 1..T-1 (eval mode, no grad, micro-batched)."""
        batch = self._batch({"input_ids": input_ids} if attention_mask is None
                            else {"input_ids": input_ids, "attention_mask": attention_mask})
        was = self.model.training
        self.model.eval()
        try:
            ids, am = batch["input_ids"], batch["attention_mask"]
            chunks = self._chunks(ids.shape[0])
            if self.sharded:
                from minite.engines import fsdp
                fsdp.check_chunks(len(chunks))
            padded = not bool(am.all())
            return torch.cat([self._token_logprobs(ids[sl], am[sl] if padded else None) for sl in chunks])
        finally:
            self.model.train(was)

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next updates (a schedule sets it before each update)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def save_pretrained(self, path: str | Path) -> None:
        """The model's weights as a local Hugging Face checkpoint (config.json + safetensors); sharded, rank 0
        writes the gathered weights, in the compute dtype as one process would."""
        if not self.sharded:
            self.model.save_pretrained(str(path), safe_serialization=True)
            return
        from minite.engines import fsdp
        dtype = torch.float32 if self._compute_fp32 else torch.bfloat16
        sd = fsdp.full_model_state(self.model, dtype)
        if D.is_main():
            self.model.save_pretrained(str(path), state_dict=sd, safe_serialization=True)
        D.barrier()

    # -------------------------------------------------------------------------------------------- sync
    def export_weights(self) -> dict:
        """{"form": "bf16"|"nvfp4_codes", "tensors": {hf_param_name: ...}} (docs/ENGINES.md, Sync).
        bf16: a BF16 copy of every parameter. nvfp4_codes: NVFP4Tensor per quantized linear — the cached
        codes of the current weights, the very ones the trainer's next forwards use (one quantization per
        update) — a list of E NVFP4Tensors per quantized expert parameter, BF16 copies of the rest.
        Sharded: every rank gets the whole payload, gathered layer by layer in buckets (``sharded_sync``)."""
        if self.sharded:
            from minite.engines.sharded_sync import export_sharded
            payload, self.last_export = export_sharded(self)
            return payload
        params = dict(self.model.named_parameters())
        if self.arm.sync == "bf16":
            return {"form": "bf16", "tensors": {n: p.detach().to(torch.bfloat16).clone() for n, p in params.items()}}
        codes = {}
        for mname, mod in self.model.named_modules():
            prefix = f"{mname}." if mname else ""
            if isinstance(mod, Q.NVFP4Linear) or hasattr(mod, "quantized") and hasattr(mod, "cache"):
                codes[prefix + "weight"] = mod.quantized().tensor()
            q = getattr(mod, "minite_quant", None)
            if q is not None:
                codes[prefix + "gate_up_proj"] = q.gate_up.get(mod.gate_up_proj).tensors()
                codes[prefix + "down_proj"] = q.down.get(mod.down_proj).tensors()
        tensors = {n: codes[n] if n in codes else p.detach().to(torch.bfloat16).clone() for n, p in params.items()}
        return {"form": "nvfp4_codes", "tensors": tensors}

    # ------------------------------------------------------------------------------------- checkpoints
    def identity(self) -> dict:
        return {"arm": self.arm.name, "model": self.model_cfg["name"], "layers": self.model_cfg["num_hidden_layers"]}

    def check_identity(self, state: dict, path) -> None:
        mine = tuple(self.identity().values())
        theirs = (state["arm"], state["model"], state["layers"])
        if mine != theirs:
            raise ValueError(f"checkpoint {path} is for (arm, model, layers) = {theirs}, this trainer is {mine}")

    def rng_state(self) -> dict:
        return {"torch": torch.get_rng_state(), "sr": self.qstate.generator.get_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}

    def save(self, path: str | Path) -> None:
        """Atomic checkpoint: fp32 masters, optimizer state, update count and every RNG stream. One process:
        one file; sharded: a DCP directory written by every rank (``fsdp.save``)."""
        if self.sharded:
            from minite.engines import fsdp
            fsdp.save(self, path)
            return
        state = {
            **self.identity(), "update_count": self.update_count, "quant_version": self.qstate.version,
            "rounding_seed": self.rounding_seed, "master": {n: m for n, m in zip(self.names, self.master, strict=True)},
            "optimizer": self.optimizer.state_dict(), "rng": self.rng_state(),
        }
        with atomic_path(path, "wb") as f:
            torch.save(state, f)

    def load(self, path: str | Path) -> None:
        """Load a checkpoint of either form, whatever number of processes wrote it."""
        from minite.engines import fsdp
        if self.sharded:
            state = fsdp.load(self, path)
        else:
            if fsdp.is_sharded_checkpoint(path):
                state = fsdp.load_into_single(path, self.names)
            else:
                state = torch.load(path, map_location="cpu", weights_only=True)
            self.check_identity(state, path)
            with torch.no_grad():
                for n, m, p in zip(self.names, self.master, self.params, strict=True):
                    m.copy_(state["master"][n])
                    p.copy_(m)
            self.optimizer.load_state_dict(state["optimizer"])
        self.update_count = state["update_count"]
        self.rounding_seed = state.get("rounding_seed", self.rounding_seed)
        rng = state["rng"]
        if rng is not None:       # a checkpoint of another world size has no stream for this rank
            torch.set_rng_state(rng["torch"])
            self.qstate.generator.set_state(rng["sr"])
            if rng["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        self.qstate.bump()
