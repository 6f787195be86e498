"""Quantized by default: what each `swarm.compression` costs a real swarm's eval loss, and its bytes.

The convergence table's real-swarm point (bench/convergence.py: configs/tiny.yaml with 2 layers, 4 peer processes
over loopback, H = 50, outer lr 0.7, 400 inner steps per peer, the sim's sample-weighted mean) run once per
compression. What decided `swarm.compression`'s default (swarm/config.py).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.common import md_table, stamp
from bench.convergence import M, diloco_swarm

FULL = dict(steps=400, h=50, rows=[("none", False), ("fp16", False), ("int8", False), ("int8", True)])
QUICK = dict(steps=60, h=30, rows=[("none", False), ("int8", True)])
BYTES = {"none": 4.0, "fp16": 2.0, "int8": 1 + 4 / 64}  # per element on the wire (swarm/net/codec.py)


def run(quick: bool) -> dict:
    spec = QUICK if quick else FULL
    rows, raw = [], []
    with tempfile.TemporaryDirectory(prefix="bench-quant-") as tmp:
        for comp, feedback in spec["rows"]:
            start = time.time()
            r = diloco_swarm(spec["steps"], spec["h"], 0.7, Path(tmp),
                             swarm={"compression": comp, "error_feedback": feedback}, tag=f"-{comp}-{feedback}")
            raw.append({"compression": comp, "error_feedback": feedback, **r})
            print(f"  quantized: {comp} ef={feedback}: {r.get('eval_loss', r.get('error'))} "
                  f"({time.time() - start:.0f}s)", flush=True)
    base = raw[0].get("eval_loss")
    for r in raw:
        loss = r.get("eval_loss")
        rows.append([r["compression"], "on" if r["error_feedback"] else "off",
                     f"{loss:.4f}" if loss is not None else f"failed: {r.get('error', '')[:60]}",
                     f"{loss - base:+.4f}" if loss is not None and base is not None else "–",
                     f"{BYTES[r['compression']]:.3f}", "yes" if r.get("identical_globals") else "no",
                     f"{r.get('wall_s', 0):.0f}"])
    table = md_table(["compression", "error feedback", "eval loss (peer 0)", "vs none", "bytes / element",
                      "one final hash", "wall s"], rows)
    table += (f"\n\nOne run per row, {M} peer processes on 2 shared cores, H = {spec['h']}, outer lr 0.7, "
              f"{spec['steps']} inner steps per peer. Run-to-run noise of this point: about 0.01 (bench/results "
              f"§7's unattacked rows). " + __doc__.split("\n\n")[1].replace("\n", " "))
    return {"table": table, "rows": raw, "timestamp": stamp()}
