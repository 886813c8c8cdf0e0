"""Recording a dense Hugging Face model (Llama-style) through ``transformers`` itself.

A DeepseekV3 folder loads into our own ``Transformer`` (``model.load_checkpoint``) and gets every hook.
Any other ``model_type`` (``llama``, ``mistral``, ``qwen2``...) runs here, through
``AutoModelForCausalLM`` with eager attention, behind the same two seams the recorder uses for our
model: ``stream(...)`` yields ``model.generate.Step`` objects, and ``make_recorder(...)`` returns an
object with ``hooks()`` and ``collect()`` that turns each step into the same tables:

- tokens: from the step's logits (the recorder does this for every model);
- attention: from ``output_attentions``; the prompt is prefilled in blocks of ``attn_chunk`` query
  rows through the KV cache, so at most [H, chunk, S] probabilities exist at once;
- routing: none (a dense model has no router);
- kv / kv_tokens: from the ``transformers`` cache's key/value tensors (``latent_norm`` holds the
  L2 norm of a token's cached values over all kv heads, ``rope_norm`` that of its rotated keys).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from workbench.model.generate import Step, check_prompt, decode
from workbench.probes.signals import attention_received, attention_stats, kv_token_norms

from .recorder import add_received, attention_rows, kv_rows, kv_token_cols, steps_rows

# model types that load into our own Transformer instead
NATIVE_TYPES = ("deepseek_v3",)


def folder_model_type(path: str | Path) -> str | None:
    """``model_type`` of a Hugging Face folder's config.json; None for our own checkpoints or non-folders."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def is_foreign_folder(path: str | Path) -> bool:
    """True for a Hugging Face folder that ``transformers`` must run (not DeepseekV3, not ours)."""
    mt = folder_model_type(path)
    return mt is not None and mt not in NATIVE_TYPES


class HFArgs:
    """The few ``ModelArgs``-like facts the recorder asks of a model."""

    def __init__(self, config):
        self.config = config
        self.max_seq_len = int(getattr(config, "max_position_embeddings", 2048) or 2048)
        self.n_layers = int(config.num_hidden_layers)
        self.n_heads = int(config.num_attention_heads)

    def to_dict(self) -> dict:
        return self.config.to_dict()


class HFModel(torch.nn.Module):
    """A ``transformers`` causal LM wrapped for the recorder (``stream`` + ``make_recorder``)."""

    def __init__(self, hf: torch.nn.Module, folder: str | Path, attn_chunk: int = 512):
        super().__init__()
        self.hf = hf.eval()
        self.args = HFArgs(hf.config)
        self.checkpoint_path = str(folder)
        self.attn_chunk = attn_chunk
        self._listener: HFRecorder | None = None

    def make_recorder(self, run_id: str, probes: Iterable[str], topk: int = 5) -> "HFRecorder":
        self._listener = HFRecorder(self, run_id, probes, topk)
        return self._listener

    def _forward(self, ids: list[int], cache, start_pos: int, observe: bool):
        device = next(self.hf.parameters()).device
        out = self.hf(torch.tensor([ids], device=device), cache=cache, use_cache=True,
                      output_attentions=observe)
        if observe and self._listener is not None:
            self._listener.observe(out.attentions, start_pos)
        return out.logits[0].float(), out.cache

    def stream(self, prompt: Sequence[int], max_new_tokens: int = 64, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, eos_id: int | None = None) -> Iterator[Step]:
        """Like ``model.generate.stream``: the prefill step (in query blocks), then one step per token."""
        from transformers import DynamicCache

        prompt = check_prompt(prompt, max_new_tokens, self.args.max_seq_len)
        observe = self._listener is not None and self._listener.wants_attention
        cache = DynamicCache(config=self.hf.config)

        def forward(ids: list[int], pos: int, index: int) -> torch.Tensor:
            nonlocal cache
            # the prompt goes in blocks of query rows when attention is observed: eager attention then
            # materialises [H, chunk, S] per layer instead of [H, T, T]
            chunk = self.attn_chunk if observe and index == 0 else len(ids)
            parts = []
            for c0 in range(0, len(ids), chunk):
                logits, cache = self._forward(ids[c0:c0 + chunk], cache, pos + c0, observe)
                parts.append(logits)
            if self._listener is not None:
                self._listener.cache = cache
            return torch.cat(parts) if len(parts) > 1 else parts[0]

        with torch.inference_mode():
            yield from decode(forward, prompt, max_new_tokens, temperature, top_p, seed, eos_id)


class HFRecorder:
    """Per-step reductions for an ``HFModel`` (the same frames as ``workbench.recorder.Recorder``)."""

    def __init__(self, model: HFModel, run_id: str, probes: Iterable[str], topk: int = 5):
        self.model, self.run_id, self.topk = model, run_id, topk
        self.probes = set(probes)
        self.wants_attention = bool({"attention", "kv"} & self.probes)
        self.attention: list[dict] = []
        self.received: dict[int, torch.Tensor] = {}
        self.cache = None

    def hooks(self) -> dict:
        return {}  # transformers hands its attentions over directly (see HFModel._forward)

    def observe(self, attentions: Sequence[torch.Tensor], q_start: int) -> None:
        """Reduce one forward's attention probabilities: [B, H, Tc, S] per layer."""
        for layer, a in enumerate(attentions):
            p = a[0].detach().float().transpose(0, 1)  # [Tc, H, S]
            if "attention" in self.probes:
                self.attention.append({"layer": layer, **attention_stats(p, q_start)})
            if "kv" in self.probes:
                add_received(self.received, layer, attention_received(p))

    def collect(self, step_index: int, start_pos: int, n_fed: int, tokens_frame: list | None,
                wall_ms: float, final: bool) -> dict:
        rid = self.run_id
        out: dict = {}
        if tokens_frame is not None:
            out["tokens"] = tokens_frame
        if self.attention:
            out["attention"] = attention_rows(rid, self.attention)
        if "kv" in self.probes and self.cache is not None:
            rows, tok_frames = [], []
            for i, layer in enumerate(self.cache.layers):
                keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
                if keys is None or values is None or keys.numel() == 0:
                    continue
                n = keys.size(-2)
                rows.append((i, n, keys.numel() * keys.element_size() + values.numel() * values.element_size()))
                if final or step_index == 0:
                    # [B, Hkv, S, d] -> [S, Hkv*d]: a token's cached vectors over all kv heads
                    k = keys[0].transpose(0, 1).flatten(1)
                    v = values[0].transpose(0, 1).flatten(1)
                    tok_frames.append(kv_token_cols(i, n, kv_token_norms(v, k), self.received))
            out.update(kv_rows(rid, step_index, rows, tok_frames))
        if "steps" in self.probes:
            out["steps"] = steps_rows(rid, step_index, n_fed, wall_ms)
        self.attention = []
        return out


def load_hf(folder: str | Path, dtype: torch.dtype | None = None, device: str = "cpu",
            attn_chunk: int = 512) -> HFModel:
    """Load a local Hugging Face causal-LM folder (never downloads) with eager attention."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a model folder (no config.json)")
    try:
        # use_safetensors: a folder holding only pickled *.bin weights is refused, never unpickled
        hf = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, attn_implementation="eager",
                                                  dtype=dtype or torch.float32, use_safetensors=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot load {folder} with transformers: {str(e).splitlines()[0]}") from None
    return HFModel(hf.to(device), folder, attn_chunk)
