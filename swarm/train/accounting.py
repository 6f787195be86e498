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
                    K = 1: the exchange's average, in the wire's bytes until it lands (int8: 1.0625)  w B x N / F
                    with diloco.delay >= 1, the pseudo-gradient the exchange in flight took (swarm/train/overlap.py;
                    fp16 with a lossy codec), alive through the next tau inner steps      2 or 4 B x N / (K F)
    host (K = 1)    error-feedback residual, with a lossy codec                   4 B x N / F
    page cache      the served copy of global parameters and momentum (file-backed, evictable)   8 B x N
                    the exchange's two node-local files, pseudo-gradient and average (swarm/train/sharding.py),
                    shared by the ranks, read and written a chunk at a time           8 B x N

`plan` lists these items for a config (the moments at 2 B per parameter with adamw8bit); `swarm peer --dry-run`
prints it per rank, also on a machine that cannot hold it (peers/inspect.py).

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


@dataclass(frozen=True)
class Item:
    """One line of a memory plan: what, where ("device" and "host": per rank; "page cache": per node, file-backed
    and evictable), and its bytes."""

    what: str
    where: str
    bytes: float


def plan(cfg: Config, shapes: Shapes, ranks: int, vocab_size: int) -> list[Item]:
    """What each rank of a peer of `ranks` ranks holds, item by item (the module docstring's table; with
    `inner.optimizer: adamw8bit` the moments take 2 bytes per parameter)."""
    from swarm.net.codec import get_codec, kept_dtype

    k = ranks if cfg.inner.parallel == "fsdp" else 1
    n, f = shapes.params, cfg.diloco.fragments
    eight_bit = cfg.inner.optimizer == "adamw8bit"
    items = [Item("fp32 parameters", "device", 4 * n / k), Item("fp32 gradients", "device", 4 * n / k),
             Item(f"AdamW moments{' (8-bit)' if eight_bit else ''}", "device", (2 if eight_bit else 8) * n / k)]
    if k > 1:
        items.append(Item("the block FSDP gathers whole, and the next one prefetched", "device",
                          2 * 4 * shapes.block_params))
    items.append(Item("activations of one micro-batch (an estimate)", "device", activation_bytes(cfg, vocab_size)))
    outer = "host" if cfg.diloco.global_device == "cpu" else "device"  # the global parameters and their kin
    items.append(Item("fp32 global parameters and outer momentum", outer, 8 * n / k))
    codec = get_codec(cfg.swarm.compression)
    if k == 1:  # a sharded peer's average stays in a node-local file, its rows read a tensor at a time
        items.append(Item(f"the exchange's average, in the wire's bytes ({codec.name})", "host",
                          codec.wire_bytes(n) / f))
    if k == 1 and cfg.swarm.error_feedback and codec.lossy:
        items.append(Item("the exchange's error-feedback residual (fp32)", "host", 4 * n / f))
    if cfg.diloco.delay:
        kept = kept_dtype(cfg.swarm.compression)
        items.append(Item(f"the pseudo-gradient a delayed exchange took ({str(kept).removeprefix('torch.')})", outer,
                          kept.itemsize * n / (k * f)))
    if k > 1:
        items += [Item("the served copy of global parameters and momentum", "page cache", 8 * n),
                  Item("the exchange's node-local files (pseudo-gradient, average)", "page cache", 8 * n)]
    return items


def memory(cfg: Config, shapes: Shapes, ranks: int, vocab_size: int) -> dict[str, float]:
    """Bytes per device, per rank on the host, per node on the host and in the page cache, for a peer of `ranks`
    ranks: `plan`'s items summed."""
    items = plan(cfg, shapes, ranks, vocab_size)
    total = {where: sum(i.bytes for i in items if i.where == where) for where in ("device", "host", "page cache")}
    return {"device_per_rank": total["device"], "host_per_rank": total["host"],
            "host_per_node": ranks * total["host"], "page_cache": total["page cache"]}


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
