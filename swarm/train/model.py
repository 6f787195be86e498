"""The causal language model: a transformers Llama built from `ModelConfig`, or loaded with `from_pretrained`."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from swarm.config import ModelConfig


def build_model(cfg: ModelConfig, vocab_size: int, tokenizer: str = "bytes") -> PreTrainedModel:
    """A seeded random-init Llama (every peer of a run builds the same weights), or the model of a Hugging Face
    folder (swarm/state/pretrained.py: its embedding must fit `tokenizer`'s `vocab_size`); fp32 either way (the
    weights AdamW updates; `inner.precision: bf16` computes in bf16 under autocast)."""
    if cfg.pretrained is not None:
        from swarm.state.pretrained import load

        return load(cfg, vocab_size, tokenizer)
    config = LlamaConfig(
        vocab_size=cfg.vocab_size or vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return LlamaForCausalLM(config)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
