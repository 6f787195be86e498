"""Memory and round-time accounting of a peer, from its config and its model's shapes: what a GPU and a host of a
(sharded) peer hold, and the share of a round spent computing at a given link speed. The same accounting
bench/shards.py measures on CPU (24 bytes per parameter of training state, 1/K of it per rank of a sharded
peer, the same on rank 0); configs/llama-30b.yaml is its worked example.

Per rank of a peer of K ranks (`inner.parallel: fsdp`; with ddp, or K = 1, every rank holds all of it):

    on the device   fp32 parameters, gradients, AdamW exp_avg and exp_avg_sq     16 B x N / K
                    the block FSDP gathers whole, and the next one prefetched    2 x 4 B x (largest block)
                    activations (activation checkpointing: each block's input kept, one block recomputed, the
                    logits of one micro-batch)                                    `activation_bytes`
    where diloco.global_device says (cpu: host memory)
                    fp32 global parameters and outer momentum                     8 B x N / K
    page cache      the served copy of global parameters and momentum (file-backed, evictable)   8 B x N
                    the exchange's two node-local files, pseudo-gradient and average (swarm/sharding.py),
                    shared by the ranks, read and written a chunk at a time           8 B x N

The round (`round_projection`): an all-reduce of the pseudo-gradient, V = the codec's bytes of N elements, over
a butterfly of n peers moves ~ 2 (n - 1) / n x V per peer, half each way on a full-duplex link; H inner steps of
`step_s` each compute. Blocking, the exchange adds to the round; with `diloco.delay` tau each of the F exchanges
(`diloco.fragments`, 1/F of the bytes each) hides behind tau inner steps and only what outlasts them is lost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarm.config import Config

GiB = 2 ** 30


@dataclass(frozen=True)
class Shapes:
    """What the accounting needs of a model: its parameter count and its largest transformer block's."""

    params: int
    block_params: int


def shapes_of(cfg: Config, vocab_size: int) -> Shapes:
    """The Llama of `cfg.model` (tied embeddings, SwiGLU, grouped-query attention), counted without building it."""
    m = cfg.model
    head = m.hidden_size // m.num_heads
    kv = (m.num_kv_heads or m.num_heads) * head
    block = m.hidden_size * (2 * m.hidden_size + 2 * kv) + 3 * m.hidden_size * m.intermediate_size + 2 * m.hidden_size
    return Shapes(m.num_layers * block + (m.vocab_size or vocab_size) * m.hidden_size + m.hidden_size, block)


def activation_bytes(cfg: Config, vocab_size: int) -> int:
    """One micro-batch's activations under bf16 autocast with activation checkpointing (fp32 without bf16; without
    checkpointing every block's working set is kept): a rough upper estimate, not a measurement."""
    m, d = cfg.model, cfg.data
    tokens = (cfg.inner.micro_batch_size or d.batch_size) * d.seq_len
    width = 2 if cfg.inner.precision == "bf16" else 4
    per_block = tokens * (10 * m.hidden_size + 3 * m.intermediate_size) * width  # one block's working set
    kept = tokens * m.hidden_size * width * m.num_layers if cfg.inner.activation_checkpointing else \
        per_block * m.num_layers
    logits = 3 * tokens * (m.vocab_size or vocab_size) * 4  # logits, softmax and its gradient, fp32
    return kept + per_block + logits


def memory(cfg: Config, shapes: Shapes, ranks: int, vocab_size: int) -> dict[str, float]:
    """Bytes per device, per rank on the host, per node on the host and in the page cache, for a peer of `ranks`
    ranks."""
    k = ranks if cfg.inner.parallel == "fsdp" else 1
    n = shapes.params
    outer = 8 * n / k
    on_host = cfg.diloco.global_device == "cpu"
    device = 16 * n / k + (2 * 4 * shapes.block_params if k > 1 else 0) + activation_bytes(cfg, vocab_size) + \
        (0 if on_host else outer)
    host_rank = outer if on_host else 0
    return {"device_per_rank": device, "host_per_rank": host_rank, "host_per_node": ranks * host_rank,
            "page_cache": 16 * n if k > 1 else 0}


def round_projection(cfg: Config, params: int, step_s: float, link_bytes_per_s: float, peers: int) -> dict:
    """Seconds of compute and of all-reduce per round, and the share of the round spent computing, blocking and
    with the config's delay."""
    from swarm.net.codec import get_codec

    payload = get_codec(cfg.swarm.compression).wire_bytes(params)
    comm = 2 * (peers - 1) / peers * payload / 2 / link_bytes_per_s  # full duplex: half each way at once
    compute = cfg.diloco.inner_steps * step_s
    delay = cfg.diloco.delay if isinstance(cfg.diloco.delay, int) else 0
    f = cfg.diloco.fragments  # F exchanges of 1/F of the bytes, each hidden behind `delay` inner steps
    lost = f * max(0.0, comm / f - delay * step_s)
    return {"payload_bytes": payload, "comm_s": comm, "compute_s": compute,
            "utilization_blocking": compute / (compute + comm), "utilization_delayed": compute / (compute + lost)}


def step_seconds(cfg: Config, params: int, ranks: int, device_flops: float, mfu: float) -> float:
    """An inner step's seconds on `ranks` devices of `device_flops` at `mfu`: 6 N FLOPs per token (8 N with
    activation checkpointing, which recomputes the forward pass)."""
    tokens = cfg.data.batch_size * cfg.data.seq_len
    per_token = (8 if cfg.inner.activation_checkpointing else 6) * params
    return tokens * per_token / (ranks * device_flops * mfu)


def gib(nbytes: float) -> float:
    return math.ceil(nbytes / GiB * 10) / 10
