"""Optional sampling backend on real vLLM, serving a checkpoint written by ``export_modelopt``.

``VLLMSampler(checkpoint_dir).generate(...)`` has the contract of ``Sampler.generate`` (tokens, prompt_lens,
response_mask, per-token log-probs of the sampled tokens) on ``vllm.LLM`` with ``logprobs=1``; vLLM's default
log-prob mode is the raw model distribution (temperature 1, before top-p), as ours. ``vllm`` is imported only
when the class is built; without it a clear ImportError says how to install it.

UNTESTED in this repository: vLLM's W4A4 NVFP4 kernels need a Blackwell GPU (on Hopper vLLM falls back to
emulation or a weight-only Marlin path, which is not the naive arm's W4A4 numerics). Weight sync to a running
vLLM is by re-export + reload (``reload(checkpoint_dir)``), not in-place.
"""
from __future__ import annotations

import torch

from minite.engines.sampler import GenerationOutput
from minite.tokenizer import EOS, PAD

INSTALL_HINT = ("the vllm sampling backend needs vLLM: pip install minite[vllm] on a Blackwell node "
                "(it pins its own torch: use a separate environment)")


def _import_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from None
    return vllm


class VLLMSampler:
    def __init__(self, checkpoint_dir, max_batch: int = 64, max_seq_len: int | None = None, seed: int = 0,
                 **llm_kwargs):
        self._vllm = _import_vllm()
        self.max_batch, self.max_seq_len, self.seed, self.llm_kwargs = max_batch, max_seq_len, seed, llm_kwargs
        self.reload(checkpoint_dir)

    def reload(self, checkpoint_dir) -> None:
        """(Re)load an exported ModelOpt checkpoint (how synced weights reach vLLM here)."""
        kw = dict(model=str(checkpoint_dir), quantization="modelopt_fp4", skip_tokenizer_init=True,
                  max_num_seqs=self.max_batch, seed=self.seed, enforce_eager=True)
        if self.max_seq_len:
            kw["max_model_len"] = self.max_seq_len
        kw.update(self.llm_kwargs)
        self.llm = self._vllm.LLM(**kw)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, generator: torch.Generator | None = None, stop_token: int | None = EOS,
                 ) -> GenerationOutput:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: expected a non-empty list of non-empty token-id lists")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=generator).item())
        params = SamplingParams(n=1, temperature=temperature, top_p=top_p, max_tokens=int(max_new_tokens),
                                logprobs=1, seed=seed, detokenize=False,
                                stop_token_ids=[stop_token] if stop_token is not None else None)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params)
        b = len(prompts)
        resp = [list(o.outputs[0].token_ids) for o in outs]
        lps = [[d[t].logprob for t, d in zip(r, o.outputs[0].logprobs)] for r, o in zip(resp, outs)]
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        width = max(len(p) + len(r) for p, r in zip(prompts, resp))
        tokens = torch.full((b, width), PAD, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        logprobs = torch.zeros((b, width), dtype=torch.float32)
        for i, (p, r, lp) in enumerate(zip(prompts, resp, lps)):
            tokens[i, :len(p)] = torch.tensor(p)
            tokens[i, len(p):len(p) + len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, len(p):len(p) + len(r)] = 1
            logprobs[i, len(p):len(p) + len(r)] = torch.tensor(lp, dtype=torch.float32)
        return GenerationOutput(tokens, lens, mask, logprobs, None)
