"""The inner loop's pieces, plain PyTorch: the AdamW optimizer and its schedule, one inner step over
micro-batches under the configured precision, and the held-out eval. Nothing here knows about peers.

Precision: the model's parameters are fp32 and stay fp32 (AdamW's master weights, the gradients, the
moments); `inner.precision: bf16` runs forward and backward under `torch.autocast(dtype=bfloat16)`, the
recipe of every DiLoCo anchor (OpenDiLoCo, torchft), instead of casting the weights themselves to bf16.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Optional

import torch

from swarm.config import Config, InnerConfig
from swarm.errors import UsageError


def lr_lambda(cfg: InnerConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine to `min_lr_ratio` at `total_steps`."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def autocast(precision: str, device: str) -> Callable[[], ContextManager]:
    """A factory of the context that forward passes run under; UsageError if `device` cannot do `precision`."""
    if precision == "fp32":
        return contextlib.nullcontext
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError(f"inner.precision bf16: device {device} ({torch.cuda.get_device_name(device)}) "
                         f"has no bf16 support; use inner.precision fp32")
    if kind not in ("cuda", "cpu"):
        raise UsageError(f"inner.precision bf16: not supported on device {device}; use inner.precision fp32")
    return lambda: torch.autocast(device_type=kind, dtype=torch.bfloat16)


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """`inner.optimizer`: torch's AdamW, or bitsandbytes' 8-bit AdamW (UsageError if it cannot run here)."""
    inner = cfg.inner
    if inner.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kwargs = dict(lr=inner.lr, betas=(inner.beta1, inner.beta2), eps=inner.eps, weight_decay=inner.weight_decay)
    if inner.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), **kwargs)
    device = next(model.parameters()).device
    try:
        import bitsandbytes as bnb

        probe = torch.nn.Parameter(torch.zeros(4096, device=device))
        probe.grad = torch.ones_like(probe)
        bnb.optim.AdamW8bit([probe], **kwargs).step()  # the 8-bit kernels for this device, tried once
    except Exception as e:  # ImportError, or no kernel for this device or build
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"inner.optimizer adamw8bit: bitsandbytes cannot run on {device} here ({reason})") from None
    return bnb.optim.AdamW8bit(model.parameters(), **kwargs)


def forward_backward(model: torch.nn.Module, batch: torch.Tensor, micro_batch_size: int,
                     precision: Callable[[], ContextManager]) -> torch.Tensor:
    """Accumulate into `.grad` the gradient of the mean loss over `batch`, `micro_batch_size` sequences per
    pass; return that loss (a 0-d tensor, not synced). Every sequence has the same number of tokens, so the
    mean of the micro-batches' mean losses is the whole batch's mean loss. `model` may be a DDP module or an FSDP2
    one (swarm/train/sharding.py)."""
    parts = batch.split(micro_batch_size)
    total = torch.zeros((), device=batch.device)
    sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2's no_sync
    for i, part in enumerate(parts):
        last = i == len(parts) - 1  # under DDP or FSDP, gradients are reduced once, in the last backward pass
        if sync is not None:
            sync(last)
        with contextlib.nullcontext() if last else getattr(model, "no_sync", contextlib.nullcontext)():
            with precision():
                loss = model(input_ids=part, labels=part).loss / len(parts)
            loss.backward()
        total += loss.detach().float()
    return total


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[torch.Tensor], device: str,
             precision: Callable[[], ContextManager] = contextlib.nullcontext,
             micro_batch_size: Optional[int] = None) -> float:
    """Mean held-out loss over `batches`, `micro_batch_size` sequences per forward pass (None: a batch at once), so
    that evaluating never holds more activations and logits than a training micro-step: the logits alone of one
    batch of 512 x 1024 tokens over a 32k vocabulary are 62.5 GiB in fp32. Every sequence has the same number of
    tokens, so the mean of the passes' mean losses, weighted by their sequences, is the batch's mean loss."""
    model.eval()
    total, sequences = 0.0, 0
    for batch in batches:
        for part in batch.split(micro_batch_size or len(batch)):
            part = part.to(device)
            with precision():
                total += model(input_ids=part, labels=part).loss.item() * len(part)
            sequences += len(part)
    model.train()
    if hasattr(model, "reshard"):  # FSDP2 keeps the root's gathered parameters after a forward with no backward:
        model.reshard()  # drop them, or the next forward would miss what is written to the shards meanwhile
    return total / sequences
