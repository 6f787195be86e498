"""Codecs on their own: round-trip error bounds (random and real pseudo-gradients), wire-format checks,
determinism, NaN/Inf never hidden, and the small-tensor split."""

import math

import pytest
import torch
from hivemind.proto import runtime_pb2

from swarm.net.codec import (
    FP32_BELOW,
    CodecError,
    get_codec,
    join_from_wire,
    part_residual,
    quantized_mask,
    split_for_wire,
)
from tests.conftest import tiny_config

# Per scheme: (bound on relative L2 error of one round trip on any of the test vectors, bound on |error| per
# element / its block's absmax; fp16: / |element|, plus 1e-7 for fp16 subnormals).
BOUNDS = {"none": (0.0, 0.0), "fp16": (1e-3, 1e-3), "int8": (0.02, 1 / 250), "int4": (0.15, 1 / 14 + 1e-6)}
BLOCK = {"none": 1, "fp16": 1, "int8": 64, "int4": 32}
BYTES_PER_ELEMENT = {"none": 4, "fp16": 2, "int8": 1 + 4 / 64, "int4": 0.5 + 4 / 32}


@pytest.fixture(scope="module")
def real_pseudo_grad() -> torch.Tensor:
    """A real pseudo-gradient: the tiny Llama after 8 AdamW steps on the embedded corpus, minus its start."""
    from swarm.data import TrainBatches, load_corpus
    from swarm.model import build_model

    cfg = tiny_config(model={"hidden_size": 64, "intermediate_size": 172})
    torch.manual_seed(0)
    corpus = load_corpus(cfg.data)
    model = build_model(cfg.model, corpus.tokenizer.vocab_size)
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay)
    batches = TrainBatches(corpus, cfg.data, 0)
    for step in range(8):
        x = batches.batch(step)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([(s - p.detach()).reshape(-1) for s, p in zip(start, model.parameters())])


def heavy_tailed(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 1e-3
    x[torch.randint(0, n, (n // 500,), generator=g)] *= 30  # outliers
    return x


def check_bounds(name: str, x: torch.Tensor) -> float:
    codec = get_codec(name)
    y = codec.decode(codec.encode(x), x.numel())
    assert y.dtype == torch.float32 and y.shape == x.shape
    rel = ((y - x).norm() / x.norm()).item()
    rel_bound, elem_bound = BOUNDS[name]
    assert rel <= rel_bound, f"{name}: relative error {rel:.4f} > {rel_bound}"
    block = BLOCK[name]
    pad = (-x.numel()) % block
    absmax = torch.cat([x.abs(), x.new_zeros(pad)]).view(-1, block).amax(1).repeat_interleave(block)[:x.numel()]
    scale = absmax if block > 1 else x.abs()
    assert ((y - x).abs() <= scale * elem_bound + (1e-7 if name == "fp16" else 1e-12)).all(), f"{name}: an element is off by more than promised"
    return rel


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["none", "fp16", "int8", "int4"])
def test_round_trip_error_bounds_random_and_real(name, real_pseudo_grad):
    assert real_pseudo_grad.numel() > 50_000 and real_pseudo_grad.abs().max() > 0
    for x in (torch.randn(100_003, generator=torch.Generator().manual_seed(1)), heavy_tailed(50_001, 2),
              real_pseudo_grad):
        check_bounds(name, x)
    if name in ("int8", "int4"):  # the measured errors documented in codec.py, with a margin
        assert check_bounds(name, real_pseudo_grad) < {"int8": 0.006, "int4": 0.08}[name]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_wire_format(name):
    codec = get_codec(name)
    for n in (0, 1, 31, 32, 33, 63, 64, 65, 1001):
        x = torch.randn(n)
        msg = codec.encode(x)
        assert len(msg.buffer) == 4 * math.ceil(n / BLOCK[name]) + math.ceil(n * codec.bits / 8)
        assert len(msg.buffer) <= n * BYTES_PER_ELEMENT[name] + 5
        assert codec.decode(msg, n).shape == (n,)
        assert msg.compression not in runtime_pb2.CompressionType.values()  # hivemind refuses, never misreads
    x = torch.randn(10_000)
    assert codec.encode(x).SerializeToString() == codec.encode(x.clone()).SerializeToString()  # deterministic
    assert torch.equal(codec.decode(codec.encode(x)), codec.decode(codec.encode(x)))
    assert torch.equal(codec.round_trip(x * 0), x * 0)  # zeros stay exact


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_decode_refuses_malformed_payloads(name):
    codec, other = get_codec(name), get_codec("int4" if name == "int8" else "int8")
    msg = codec.encode(torch.randn(1000))
    with pytest.raises(CodecError, match="elements"):
        codec.decode(msg, 999)
    with pytest.raises(CodecError, match="compression type"):
        codec.decode(other.encode(torch.randn(1000)))
    with pytest.raises(CodecError, match="compression type"):
        get_codec("none").decode(msg)
    for bad in (msg.buffer[:-1], msg.buffer + b"\0"):
        forged = runtime_pb2.Tensor(); forged.CopyFrom(msg); forged.buffer = bad  # noqa: E702
        with pytest.raises(CodecError, match="bytes"):
            codec.decode(forged)
    huge = runtime_pb2.Tensor(); huge.CopyFrom(msg); huge.size[:] = [2**31 - 1]  # noqa: E702
    with pytest.raises(CodecError):
        codec.decode(huge)
    neg = runtime_pb2.Tensor(); neg.CopyFrom(msg)  # noqa: E702
    neg.buffer = torch.tensor([-1.0]).numpy().tobytes() + msg.buffer[4:]
    with pytest.raises(CodecError, match="scale of block 0"):
        codec.decode(neg)
    if name == "int4":  # code 15 is not a level
        bad = runtime_pb2.Tensor(); bad.CopyFrom(msg)  # noqa: E702
        bad.buffer = msg.buffer[:-1] + b"\xff"
        with pytest.raises(CodecError, match="out of range"):
            codec.decode(bad)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_never_hidden(name, poison):
    codec = get_codec(name)
    x = torch.randn(5000)
    x[1234] = poison
    with pytest.raises(CodecError, match=f"scale of block {1234 // BLOCK[name]} is nan"):
        codec.decode(codec.encode(x))


@pytest.mark.timeout(30)
def test_small_tensors_travel_in_fp32_and_round_trip():
    shapes = [torch.Size([128]), torch.Size([256, 128]), torch.Size([FP32_BELOW - 1]), torch.Size([FP32_BELOW]),
              torch.Size([])]
    tensors = [torch.randn(s) for s in shapes]
    assert quantized_mask(shapes, get_codec("int4")) == [False, True, False, True, False]
    assert all(quantized_mask(shapes, get_codec("none")))
    mask = quantized_mask(shapes, get_codec("int8"))
    q, exact = split_for_wire(tensors, mask)
    assert q.numel() == 256 * 128 + FP32_BELOW and exact.numel() == 128 + FP32_BELOW - 1 + 1
    for a, b in zip(join_from_wire(q, exact, shapes, mask), tensors):
        assert torch.equal(a, b) and a.shape == b.shape


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["none", "int8", "int4"])
def test_part_residual_is_what_the_owners_lose(name):
    codec, x = get_codec(name), torch.randn(10_000)
    bounds = [(0, 3333), (3333, 6666), (6666, 10_000)]
    residual = part_residual(codec, x, bounds)
    received = torch.cat([codec.decode(codec.encode(x[s:e])) for s, e in bounds])
    assert torch.equal(residual, x - received)
    assert (residual == 0).all() == (name == "none")
