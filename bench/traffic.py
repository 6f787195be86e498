"""Traffic: bytes each peer sends per round in a real swarm, against the butterfly all-reduce bound for the
codec's bit width, and the reduction against data parallel's per-step fp32 all-reduce over the same steps.

Butterfly bound per peer per round: it pushes n-1 of its n parts and serves its own averaged part to the
n-1 others, 2(n-1)/n * (wire bytes of the vector). For lossy codecs the tensors under FP32_BELOW elements
travel in fp32 (swarm/net/codec.py), so the bound counts them at 4 bytes.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import torch

from bench.common import md_table, stamp, tiny_config
from bench.swarmrun import run_swarm
from swarm.data.batches import load_corpus
from swarm.net.codec import FP32_BELOW, get_codec
from swarm.train.model import build_model

BITS = {"none": 32, "fp16": 16, "int8": 8, "int4": 4}


def wire_bytes(shapes: list[torch.Size], compression: str) -> tuple[int, int]:
    """(bytes of the vector at the codec's nominal bit width, bytes as our wire format lays them out)."""
    codec = get_codec(compression)
    big = sum(math.prod(s) for s in shapes if not codec.lossy or math.prod(s) >= FP32_BELOW)
    small = sum(math.prod(s) for s in shapes) - big
    nominal = big * BITS[compression] / 8 + small * 4
    exact = codec.wire_bytes(big) if hasattr(codec, "wire_bytes") else big * codec.bytes_per_element
    return int(nominal), int(exact + small * 4)


def run(quick: bool) -> dict:
    n, codecs = (2, ["none", "int8"]) if quick else (4, ["none", "fp16", "int8", "int4"])
    h, rounds = 10, 2
    base = tiny_config(h * rounds, h)
    shapes = [p.shape for p in build_model(base.model, load_corpus(base.data).tokenizer.vocab_size).parameters()]
    params = sum(math.prod(s) for s in shapes)
    dp_step = 2 * (n - 1) / n * 4 * params  # data parallel: one fp32 all-reduce of the gradients per step
    rows, raw = [], []
    with tempfile.TemporaryDirectory(prefix="bench-traffic-") as tmp:
        for comp in codecs:
            cfg = tiny_config(h * rounds, h, swarm={"run_id": f"bench-traffic-{comp}-{int(time.time())}",
                                                   "compression": comp})
            result = run_swarm(cfg, n, Path(tmp) / comp)
            per_round = [r["bytes_sent"] for p in result["peers"] for r in p["rounds"] if r["committed"]]
            measured = sum(per_round) / max(1, len(per_round))
            nominal, exact = (2 * (n - 1) / n * b for b in wire_bytes(shapes, comp))
            raw.append(dict(compression=comp, peers=n, bytes_per_peer_per_round=per_round, mean=measured,
                            bound_nominal=nominal, bound_wire=exact, failed=result["failed"]))
            rows.append([comp, n, f"{measured:,.0f}", f"{nominal:,.0f}", f"{measured / nominal:.3f}",
                         f"{measured / exact:.3f}", f"{h * dp_step / measured:.0f}x",
                         f"{100 * dp_step / measured:.0f}x",
                         f"{4 * params * 2 * (n - 1) / n / measured:.2f}x"])
    table = md_table(["compression", "peers", "bytes sent / peer / round (measured)", "bound at bit width",
                      "measured / bound", "measured / wire-format bound", "less than DP, H=10",
                      "less than DP, H=100", "less than fp32 round"], rows)
    table += (f"\n\n{params:,} parameters; bound = 2(n-1)/n x vector bytes (small tensors < {FP32_BELOW} elements "
              f"in fp32 for lossy codecs). Data parallel: a {4 * params:,}-byte fp32 all-reduce every step "
              f"({dp_step:,.0f} bytes sent per peer per step); DiLoCo: one per H steps.")
    return {"table": table, "config": {"peers": n, "inner_steps": h, "rounds": rounds, "params": params,
                                       "codecs": codecs, "base": base.to_dict()}, "rows": raw, "timestamp": stamp()}
