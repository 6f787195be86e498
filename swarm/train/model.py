"""The causal language model: a transformers Llama built from `ModelConfig`, or loaded with `from_pretrained`."""

from __future__ import annotations

import hashlib
from typing import Callable, Optional

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from swarm.config import ModelConfig
from swarm.train.sharding import Layout


def build_model(cfg: ModelConfig, vocab_size: int, tokenizer: str = "bytes", device: str | torch.device = "cpu",
                shard: Optional[Callable[[torch.nn.Module], None]] = None) -> PreTrainedModel:
    """A seeded random-init Llama (every peer of a run builds the same weights: `init_weights`), or the model of a
    Hugging Face folder (swarm/state/pretrained.py: its embedding must fit `tokenizer`'s `vocab_size`); fp32 either
    way (the weights AdamW updates; `inner.precision: bf16` computes in bf16 under autocast), on `device`.

    `shard` (FSDP2's `fully_shard` of a sharded peer, swarm/train/sharding.py) is applied before any weight
    exists: the model is built on the meta device, sharded, and only then given memory, so each rank allocates
    and initializes (or reads, from a pretrained folder's safetensors) its own rows: nothing ever holds the whole
    model. On the meta device: the shapes only."""
    if cfg.pretrained is not None:
        from swarm.state.pretrained import load

        return load(cfg, vocab_size, tokenizer, device, shard)
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
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if shard is not None:
        shard(model)
    if torch.device(device).type == "meta":  # shapes only (accounting, tests)
        return model
    materialize(model, device)
    init_weights(model, cfg.seed, config.initializer_range)
    return model


def materialize(model: PreTrainedModel, device: str | torch.device) -> None:
    """Memory for a model built on the meta device (and maybe sharded), its values still to be written
    (`fill_rows`); the rotary embedding's tables (buffers, not parameters) computed on `device`."""
    model.to_empty(device=device)
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        model.tie_weights()  # to_empty gave each module a tensor of its own (FSDP2's keeps them one)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("rotary_emb"):
                fresh = type(module)(module.config)
                for key, buffer in fresh.named_buffers(recurse=False):
                    getattr(module, key).copy_(buffer)


@torch.no_grad()
def fill_rows(model: torch.nn.Module, rows_of: Callable[[str, torch.Size, slice], torch.Tensor]) -> None:
    """Every parameter (a tied one once) from `rows_of(name, shape, rows)`: the rows `rows` (of dim 0) of the
    tensor `name` of `shape`, made or read one tensor at a time. A rank of a sharded model asks for its own rows
    (`own_rows`), an unsharded model for all of them."""
    for name, param in model.named_parameters():
        rows = own_rows(param)
        values = rows_of(name, param.shape, rows)
        (param.to_local() if hasattr(param, "to_local") else param).copy_(values)


def own_rows(param: torch.Tensor) -> slice:
    """The rows of dim 0 this rank holds of `param`: all of them, or for an FSDP2 shard those the sharded state's
    layout gives its rank (swarm/train/sharding.py `Layout.rows`, FSDP2's own cut)."""
    if not hasattr(param, "to_local"):
        return slice(None)
    mesh = param.device_mesh
    return slice(*Layout((param.shape,), mesh.size(), mesh.get_local_rank()).rows(0))


def init_weights(model: torch.nn.Module, seed: int, std: float) -> None:
    """Every parameter drawn from a generator of its own, seeded by (`seed`, its name): normal(0, `std`), norms
    1. A tensor's values never depend on the others' or on how the model is sharded: a sharded rank makes each
    whole tensor in turn (one at a time, on the CPU: a random stream cannot start mid-tensor) and keeps its rows,
    so K ranks hold the model one process builds."""
    fill_rows(model, lambda name, shape, rows: _initial(name, tuple(shape), seed, std)[rows])


def _initial(name: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    key = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1
    return torch.empty(shape).normal_(0.0, std, generator=torch.Generator().manual_seed(key))


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
