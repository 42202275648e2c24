"""Character-level tokenizer for the embedded synthetic tasks (tiny / small models).

Fixed vocabulary of 32 ids (a multiple of 16, so the lm_head's N is NVFP4-friendly): pad, bos, eos, the
ten digits, arithmetic symbols, a few letters for prompts. Real-scale configs use the checkpoint's own
HF tokenizer instead.
"""
from __future__ import annotations

import torch

PAD, BOS, EOS = 0, 1, 2
_CHARS = "0123456789+-*/=()?:; .,abcxyz"  # 29 symbols -> ids 3..31
VOCAB = ["<pad>", "<bos>", "<eos>"] + list(_CHARS)
assert len(VOCAB) == 32
_ID = {c: i for i, c in enumerate(VOCAB)}
UNKNOWN = "\ufffd"  # what decode gives an id the vocabulary does not have


class CharTokenizer:
    """encode/decode between strings and id lists; pad/bos/eos ids as attributes (HF-like names)."""

    pad_token_id, bos_token_id, eos_token_id = PAD, BOS, EOS
    vocab_size = len(VOCAB)

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        try:
            ids = [_ID[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the char vocabulary {''.join(VOCAB[3:])!r}") from None
        return ([BOS] if bos else []) + ids + ([EOS] if eos else [])

    def decode(self, ids, stop_at_eos: bool = True) -> str:
        """Ids -> text; an id outside the 32-symbol vocabulary (a model with a larger vocabulary) decodes to
        U+FFFD, the replacement character, rather than failing."""
        out = []
        for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids):
            if i == EOS and stop_at_eos:
                break
            if i in (PAD, BOS, EOS):
                continue
            out.append(VOCAB[i] if 0 <= i < len(VOCAB) else UNKNOWN)
        return "".join(out)
