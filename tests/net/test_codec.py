"""Codecs on their own: round-trip error bounds (random and real pseudo-gradients), wire-format checks,
determinism, NaN/Inf never hidden, and every payload checked against the length the receiver expects."""

import math

import pytest
import torch

from swarm.net.codec import CodecError, get_codec
from tests.conftest import tiny_config

# Per scheme: (bound on relative L2 error of one round trip on any of the test vectors, bound on |error| per
# element / its block's absmax; fp16: / |element|, plus 1e-7 for fp16 subnormals).
BOUNDS = {"none": (0.0, 0.0), "fp16": (1e-3, 1e-3), "int8": (0.02, 1 / 250), "int4": (0.15, 1 / 14 + 1e-6)}
BLOCK = {"none": 1, "fp16": 1, "int8": 64, "int4": 32}
BYTES_PER_ELEMENT = {"none": 4, "fp16": 2, "int8": 1 + 4 / 64, "int4": 0.5 + 4 / 32}


@pytest.fixture(scope="module")
def real_pseudo_grad() -> torch.Tensor:
    """A real pseudo-gradient: the tiny Llama after 8 AdamW steps on the embedded corpus, minus its start."""
    from swarm.data.batches import TrainBatches, load_corpus
    from swarm.train.model import build_model

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
    y = codec.round_trip(x)
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
        payload = codec.encode(x)
        assert len(payload) == codec.wire_bytes(n) == 4 * math.ceil(n / BLOCK[name]) + math.ceil(n * codec.bits / 8)
        assert len(payload) <= n * BYTES_PER_ELEMENT[name] + 5
        assert codec.decode(payload, n).shape == (n,)
    x = torch.randn(10_000)
    assert codec.encode(x) == codec.encode(x.clone())  # deterministic
    assert torch.equal(codec.decode(codec.encode(x), 10_000), codec.decode(codec.encode(x), 10_000))
    assert torch.equal(codec.round_trip(x * 0), x * 0)  # zeros stay exact


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["none", "fp16", "int8", "int4"])
def test_decode_refuses_a_payload_of_the_wrong_length_before_reading_it(name):
    codec = get_codec(name)
    payload = codec.encode(torch.randn(1000))
    for bad in (payload[:-1], payload + b"\0", b""):
        with pytest.raises(CodecError, match="bytes do not hold 1000"):
            codec.decode(bad, 1000)
    with pytest.raises(CodecError, match="bytes do not hold 990"):
        codec.decode(payload, 990)  # the receiver, not the sender, says how many elements it expects


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_decode_refuses_malformed_payloads(name):
    codec = get_codec(name)
    payload = codec.encode(torch.randn(1000))
    negative = torch.tensor([-1.0]).numpy().tobytes() + payload[4:]
    with pytest.raises(CodecError, match="scale of block 0"):
        codec.decode(negative, 1000)
    if name == "int4":  # code 15 is not a level
        with pytest.raises(CodecError, match="out of range"):
            codec.decode(payload[:-1] + b"\xff", 1000)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_never_hidden(name, poison):
    codec = get_codec(name)
    x = torch.randn(5000)
    x[1234] = poison
    with pytest.raises(CodecError, match=f"scale of block {1234 // BLOCK[name]} is nan"):
        codec.decode(codec.encode(x), 5000)


def test_fp16_clamps_and_keeps_nan():
    codec = get_codec("fp16")
    y = codec.round_trip(torch.tensor([1e6, -1e6, float("nan"), 1.0]))
    assert y[0] == 65504 and y[1] == -65504 and torch.isnan(y[2]) and y[3] == 1.0
