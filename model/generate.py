"""Autoregressive generation over the latent KV cache: one prefill, then one decode step per token.

``stream`` yields after every step so a caller (the recorder) can flush that step's signals before
the next one; ``generate`` just collects it. Sampling is greedy (temperature 0), temperature, or
nucleus (top-p), seeded through a private ``torch.Generator``.

``stream_batch`` generates for several prompts at once, as DeepSeek-V3's own ``generate`` does: every row is
fed the same positions, the first forward feeds the shortest prompt's length, and a longer prompt's remaining
tokens are fed (teacher-forced) one per forward while the shorter rows decode. The padding is only ever at the
end of a row, where causal attention never looks back at it, so no attention mask beyond the causal one is
needed and each row computes exactly what it would alone (up to floating-point summation order).
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


@dataclass
class BatchStep:
    """One forward of a batch. ``steps[b]`` is the ``Step`` row ``b`` completed in it: None while the row is
    still being fed its prompt (its prefill spans several forwards when its prompt is longer than the
    shortest; the row's step 0 then holds every prompt position's logits) and after the row has finished."""

    start_pos: int
    n_fed: int  # tokens every row was fed in this forward
    steps: list[Step | None]


def stream_batch(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                 temperature: Sequence[float], top_p: Sequence[float], seed: Sequence[int],
                 eos_id: int | None = None) -> Iterator[BatchStep]:
    """Yield one ``BatchStep`` per forward of all rows together (per-row settings). The cache holds B rows."""
    prompts = [check_prompt(p, n, model.args.max_seq_len) for p, n in zip(prompts, max_new_tokens)]
    total = max(len(p) + n - 1 for p, n in zip(prompts, max_new_tokens))
    device = next(model.parameters()).device
    model.setup_cache(len(prompts), total)
    try:
        with torch.inference_mode():
            yield from decode_batch(lambda ids, pos: model(torch.tensor(ids, device=device), start_pos=pos),
                                    prompts, max_new_tokens, temperature, top_p, seed, eos_id)
    finally:
        model.clear_cache()


def decode_batch(forward: Callable[[list[list[int]], int], torch.Tensor], prompts: list[list[int]],
                 max_new_tokens: Sequence[int], temperature: Sequence[float], top_p: Sequence[float],
                 seed: Sequence[int], eos_id: int | None) -> Iterator[BatchStep]:
    """The batched step loop (``decode`` per row, rows fed the same positions).

    Args:
        forward: ``(ids [B][T], start_pos) -> logits [B, T, V]``, the model with a B-row cache.
    """
    n = len(prompts)
    gens = [torch.Generator().manual_seed(s) for s in seed]
    tokens = [list(p) for p in prompts]  # each row's prompt, then its sampled tokens
    alive = [True] * n
    index, start = [0] * n, [0] * n  # each row's current step and the position it began at
    logits_of: list[list[torch.Tensor]] = [[] for _ in range(n)]  # logits of the row's current step so far
    pos, cur = 0, min(len(p) for p in prompts)
    while any(alive):
        # a finished row is still fed (its cache row is ignored): pad it with token 0
        ids = [t[pos:cur] if len(t) >= cur else [0] * (cur - pos) for t in tokens]
        logits = forward(ids, pos)
        steps: list[Step | None] = [None] * n
        for b in range(n):
            if not alive[b]:
                continue
            logits_of[b].append(logits[b])
            if cur < len(prompts[b]):  # the row's prompt goes on in the next forward
                continue
            lg = logits_of[b][0] if len(logits_of[b]) == 1 else torch.cat(logits_of[b])
            nxt = sample(lg[-1].cpu(), temperature[b], top_p[b], gens[b])
            steps[b] = Step(index[b], start[b], tokens[b][start[b]:cur], lg, nxt)
            tokens[b].append(nxt)
            index[b], start[b], logits_of[b] = index[b] + 1, cur, []
            if index[b] >= max_new_tokens[b] or (eos_id is not None and nxt == eos_id):
                alive[b] = False
        yield BatchStep(pos, cur - pos, steps)
        pos, cur = cur, cur + 1


@torch.no_grad()
def generate(model: Transformer, prompt: Sequence[int], max_new_tokens: int = 64, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None) -> list[int]:
    """Return the generated tokens (prompt excluded)."""
    out = []
    for step in stream(model, prompt, max_new_tokens, temperature, top_p, seed, eos_id):
        if step.next_token >= 0:
            out.append(step.next_token)
    return out
