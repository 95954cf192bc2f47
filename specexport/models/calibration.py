"""Calibration text: the target's own greedy continuations of prompts written for calibration only (none is a
bench prompt). `layers:auto` measures agreement over it (layer_search.py); a smoothed quantized copy takes its
linears' input ranges from it (smooth.py)."""

from __future__ import annotations

import torch

from .decoder import KVCache, StaticKVDecoder
from .loading import LoadedModel

CALIBRATION_PROMPTS = (  # written for calibration only: none of them is a bench prompt
    "Explain in a few sentences why the sky looks blue during the day and red at sunset.",
    "Write a Python function that returns the n-th Fibonacci number, with a short docstring.",
    "List five tips for keeping a small vegetable garden healthy through a dry summer.",
    "Reply with a JSON object describing a book: title, author, year and a list of three genres.",
    "Summarize the plot of a story in which a lighthouse keeper finds a message in a bottle.",
    "What is the difference between a list and a tuple in Python? Give an example of each.",
)
NEW_TOKENS = 48


def calibration_texts(target: LoadedModel, new_tokens: int = NEW_TOKENS) -> list[tuple[list[int], int]]:
    """-> [(prompt + the target's greedy continuation, prompt length)], one per calibration prompt."""
    return [_greedy(target.model, ids, new_tokens) for ids in _prompts(target)]


def _prompts(target: LoadedModel) -> list[list[int]]:
    tok, V = target.tokenizer, target.config.vocab_size
    if tok is None:  # ids-only checkpoints (tests): fixed pseudo-random prompts
        g = torch.Generator().manual_seed(0)
        return [torch.randint(1, V, (12,), generator=g).tolist() for _ in CALIBRATION_PROMPTS]
    if getattr(tok, "chat_template", None):
        return [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)) for p in CALIBRATION_PROMPTS]
    return [tok.encode(p) for p in CALIBRATION_PROMPTS]


@torch.inference_mode()
def _greedy(model: StaticKVDecoder, ids: list[int], n: int) -> tuple[list[int], int]:
    """The target's own greedy continuation -> (prompt + n tokens, prompt length)."""
    cfg = model.cfg
    T = len(ids) + n
    cache = KVCache.allocate(cfg, 1, T, next(model.parameters()).dtype)
    logits = model(torch.tensor([ids]), torch.zeros(1, dtype=torch.long), cache, T)
    out = list(ids)
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        if len(out) == T:
            break
        logits = model(torch.tensor([[out[-1]]]), torch.tensor([len(out) - 1]), cache, T)
    return out, len(ids)
