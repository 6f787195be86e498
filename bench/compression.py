"""Wire codecs vs hivemind's built-in compressors on the same tensors.

`python -m bench.compression [--quick]` prints a markdown table and writes bench/results/compression.json.
Tensors: a real pseudo-gradient (configs/tiny.yaml's Llama after `inner_steps` AdamW steps on the embedded
corpus, all 37 tensors flattened: what the swarm averages) and a Gaussian vector of the same size. Per scheme:
- rel_err_*: ||decode(encode(x)) - x|| / ||x|| (one round trip; the all-reduce does two: contribution, result)
- mel_per_s: compress + decompress throughput, million elements per second (best of `repeats`, 1 thread)
- bytes_per_elem and bytes_per_round: what one peer of the 4-peer tiny swarm sends per round (it pushes 3 of
  its 4 parts and serves its own part's result to 3 peers; received is the same). For ours, tensors under
  FP32_BELOW elements travel in fp32, as in the swarm; hivemind's compressors are applied to the whole vector.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from bench.common import results_dir

PEERS = 4


def real_pseudo_gradient(steps: int) -> list[torch.Tensor]:
    from swarm.data.batches import TrainBatches, load_corpus
    from swarm.run.configfile import load_config
    from swarm.train.model import build_model

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    torch.manual_seed(0)
    corpus = load_corpus(cfg.data)
    model = build_model(cfg.model, corpus.tokenizer.vocab_size)
    start = [p.detach().clone() for p in model.parameters()]
    inner = cfg.inner
    opt = torch.optim.AdamW(model.parameters(), lr=inner.lr, betas=(inner.beta1, inner.beta2), eps=inner.eps,
                            weight_decay=inner.weight_decay)
    batches = TrainBatches(corpus, cfg.data, 0)
    for step in range(steps):
        x = batches.batch(step)
        model(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip)
        opt.step()
        opt.zero_grad()
    return [s - p.detach() for s, p in zip(start, model.parameters())]


def ours(name: str, shapes) -> tuple[Callable, Callable]:
    from swarm.net.codec import FP32_BELOW, get_codec

    codec = get_codec(name)
    mask = [not codec.lossy or shape.numel() >= FP32_BELOW for shape in shapes]

    def wire(flat: torch.Tensor) -> tuple[list, int]:
        out, offset, size = [], 0, 0
        for shape, quantized in zip(shapes, mask):
            n = shape.numel()
            part = flat[offset: offset + n]
            msg = (codec if quantized else get_codec("none")).encode(part)
            out.append((quantized, msg, n))
            size += len(msg)
            offset += n
        return out, size

    def back(msgs: list) -> torch.Tensor:
        return torch.cat([(codec if q else get_codec("none")).decode(m, n) for q, m, n in msgs])
    return wire, back


def hivemind_builtin(cls) -> tuple[Callable, Callable]:
    from hivemind.compression import CompressionInfo

    compressor = cls()

    def wire(flat: torch.Tensor):
        msg = compressor.compress(flat, CompressionInfo.from_tensor(flat))
        return msg, len(msg.buffer)
    return wire, lambda msg: compressor.extract(msg).reshape(-1).float()


def measure(wire, back, x: torch.Tensor, repeats: int) -> tuple[float, float, int]:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        msg, size = wire(x)
        y = back(msg)
        best = min(best, time.perf_counter() - start)
    return ((y - x).norm() / x.norm()).item(), x.numel() / best / 1e6, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer training steps and repeats")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from hivemind.compression import (
        BlockwiseQuantization,
        Float16Compression,
        Quantile8BitQuantization,
        ScaledFloat16Compression,
        Uniform8BitQuantization,
    )

    started = time.perf_counter()
    tensors = real_pseudo_gradient(steps=5 if args.quick else 20)
    shapes = [t.shape for t in tensors]
    real = torch.cat([t.reshape(-1) for t in tensors])
    gauss = torch.randn(real.numel(), generator=torch.Generator().manual_seed(0)) * real.std()
    repeats = 2 if args.quick else 5
    schemes = {f"swarm {n}": ours(n, shapes) for n in ("none", "fp16", "int8", "int4")}
    schemes.update({
        "hivemind Float16Compression": hivemind_builtin(Float16Compression),
        "hivemind ScaledFloat16Compression": hivemind_builtin(ScaledFloat16Compression),
        "hivemind Uniform8BitQuantization": hivemind_builtin(Uniform8BitQuantization),
        "hivemind Quantile8BitQuantization": hivemind_builtin(Quantile8BitQuantization),
        "hivemind BlockwiseQuantization (bnb 8-bit, block 4096)": hivemind_builtin(BlockwiseQuantization),
    })
    rows, none_bytes = [], None
    for name, (wire, back) in schemes.items():
        try:
            rel_real, speed, size = measure(wire, back, real, repeats)
            rel_gauss, _, _ = measure(wire, back, gauss, 1)
        except Exception as e:  # e.g. hivemind's quantizers under numpy >= 2.4 (notes/hivemind.md)
            rows.append({"scheme": name, "error": repr(e)})
            continue
        per_round = round(2 * (PEERS - 1) / PEERS * size)
        none_bytes = none_bytes or per_round
        rows.append({"scheme": name, "rel_err_real": rel_real, "rel_err_gauss": rel_gauss, "mel_per_s": speed,
                     "bytes_per_elem": size / real.numel(), "bytes_per_round": per_round,
                     "vs_none": per_round / none_bytes})
    result = {"numel": real.numel(), "tensors": len(tensors), "peers": PEERS, "quick": args.quick,
              "torch_threads": 1, "seconds": time.perf_counter() - started, "rows": rows}
    written = results_dir(args.quick) / "compression.json"
    written.parent.mkdir(parents=True, exist_ok=True)
    written.write_text(json.dumps(result, indent=2))
    print(f"\n{real.numel()} elements ({len(tensors)} tensors of configs/tiny.yaml), {PEERS}-peer all-reduce, "
          f"1 thread\n")
    print("| scheme | rel. err (real) | rel. err (gauss) | compress+decompress M el/s | bytes/elem "
          "| bytes sent per peer per round | x none |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['scheme']} | failed: {r['error'][:60]} | | | | | |")
            continue
        print(f"| {r['scheme']} | {r['rel_err_real']:.2e} | {r['rel_err_gauss']:.2e} | {r['mel_per_s']:.0f} "
              f"| {r['bytes_per_elem']:.3f} | {r['bytes_per_round']:,} | {r['vs_none']:.3f} |")
    print(f"\nwritten to {written} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
