"""The network: a small DeepSeek-V3 (MLA + DeepSeekMoE + YaRN), its tokenizer, cache and generation."""
from .checkpoint import DEFAULT_CHECKPOINT, export_hf, file_sha256, load_checkpoint, save_checkpoint, state_sha256
from .generate import BatchStep, Step, generate, sample, stream, stream_batch
from .model import (
                         MLA,
                         MLP,
                         Block,
                         Expert,
                         Gate,
                         HookPoint,
                         KVCache,
                         ModelArgs,
                         MoE,
                         RMSNorm,
                         Transformer,
                         precompute_freqs_cis,
)
from .tokenizer import load_tokenizer, token_texts

__all__ = [
    "BatchStep", "DEFAULT_CHECKPOINT", "MLA", "MLP", "Block", "Expert", "Gate", "HookPoint", "KVCache", "ModelArgs", "MoE",
    "RMSNorm", "Step", "Transformer", "export_hf", "file_sha256", "generate", "load_checkpoint",
    "load_tokenizer", "precompute_freqs_cis", "sample", "save_checkpoint", "state_sha256", "stream",
    "stream_batch", "token_texts",
]
