"""Autoregressive generation over the latent KV cache: one prefill, then one decode step per token.

``stream`` yields after every step so a caller (the recorder) can flush that step's signals before
the next one; ``generate`` just collects it. Sampling is greedy (temperature 0), temperature, or
nucleus (top-p), seeded through a private ``torch.Generator``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from .model import Transformer


@dataclass
class Step:
    """One generation step. ``logits`` [T, V] are the logits at every position the step computed."""

    index: int  # 0 = prefill, n = n-th decode step
    start_pos: int
    input_ids: list[int]  # tokens fed in this step
    logits: torch.Tensor  # [T, V] fp32
    next_token: int  # sampled from logits[-1]; fed in at the next step (the last one never is)


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Pick the next token from logits [V]."""
    if not torch.isfinite(logits).all():
        # a broken model must not crash the sampler: non-finite entries are never chosen
        logits = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=float("-inf"))
        if not torch.isfinite(logits).any():
            return 0
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p  # always keeps the first
        sorted_p = sorted_p * keep
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def check_prompt(prompt: Sequence[int], max_new_tokens: int, max_seq_len: int) -> list[int]:
    """The prompt as a list, or a ValueError if it is empty or leaves no room for the new tokens."""
    prompt = list(prompt)
    if not prompt:
        raise ValueError("empty prompt: at least one token is needed")
    if len(prompt) + max_new_tokens - 1 > max_seq_len:  # the last new token is never fed: it needs no slot
        raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_seq_len {max_seq_len} (the prompt and every new token but the last are fed)")
    return prompt


def stream(model: Transformer, prompt: Sequence[int], max_new_tokens: int = 64, temperature: float = 0.0,
           top_p: float = 1.0, seed: int = 0, eos_id: int | None = None) -> Iterator[Step]:
    """Yield the prefill step, then each decode step. The model's cache is set up and cleared here."""
    prompt = check_prompt(prompt, max_new_tokens, model.args.max_seq_len)
    total = len(prompt) + max_new_tokens - 1  # positions fed: the last new token is never written to the cache
    device = next(model.parameters()).device
    model.setup_cache(1, total)
    try:
        with torch.inference_mode():
            yield from decode(lambda ids, pos, _: model(torch.tensor([ids], device=device), start_pos=pos)[0],
                              prompt, max_new_tokens, temperature, top_p, seed, eos_id)
    finally:
        model.clear_cache()


def decode(forward: Callable[[list[int], int, int], torch.Tensor], prompt: list[int], max_new_tokens: int,
           temperature: float, top_p: float, seed: int, eos_id: int | None) -> Iterator[Step]:
    """The step loop every generator shares: feed the prompt, then each sampled token, until
    ``max_new_tokens`` steps or ``eos_id``.

    Args:
        forward: ``(ids, start_pos, step_index) -> logits [len(ids), V]``, the model with its cache.
    """
    gen = torch.Generator().manual_seed(seed)
    ids, pos = prompt, 0
    for index in range(max_new_tokens):
        logits = forward(ids, pos, index)
        nxt = sample(logits[-1].cpu(), temperature, top_p, gen)
        yield Step(index, pos, ids, logits, nxt)
        pos += len(ids)
        ids = [nxt]
        if eos_id is not None and nxt == eos_id:
            return


@torch.no_grad()
def generate(model: Transformer, prompt: Sequence[int], max_new_tokens: int = 64, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None) -> list[int]:
    """Return the generated tokens (prompt excluded)."""
    out = []
    for step in stream(model, prompt, max_new_tokens, temperature, top_p, seed, eos_id):
        if step.next_token >= 0:
            out.append(step.next_token)
    return out
