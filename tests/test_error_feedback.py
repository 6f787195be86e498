"""Error feedback: over many quantized rounds the accumulated applied update tracks the fp32 one, and the
trainer adds the residual to its next pseudo-gradient and keeps it in its checkpoint (not in shared state)."""

import pytest
import torch

from swarm.net.allreduce.layout import part_bounds
from swarm.net.codec import get_codec
from swarm.state.peerstate import StateNames, shared_tensors
from swarm.train.averaging import Averager, ExchangeOutcome
from swarm.train.diloco import PseudoGradient
from swarm.train.trainer import Trainer
from tests.conftest import tiny_config


def quantized_allreduce(codec, flats, weights):
    """The all-reduce's arithmetic in one process: every part of every contribution encoded by its sender,
    reduced in fp32 by its owner, the result encoded once; returns (result, residual per sender)."""
    bounds = part_bounds(flats[0].numel(), len(flats))
    received = [torch.cat([codec.round_trip(f[s:e]) for s, e in bounds]) for f in flats]
    mean = sum(r * w for r, w in zip(received, weights)) / sum(weights)
    result = torch.cat([codec.round_trip(mean[s:e]) for s, e in bounds])
    return result, [f - r for f, r in zip(flats, received)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_accumulated_update_tracks_fp32_with_error_feedback(name):
    codec, rounds, numel, weights = get_codec(name), 30, 3000, [3.0, 1.0, 2.0]
    g = torch.Generator().manual_seed(0)
    # a small persistent signal under large noise: per-round quantization rounds much of it away
    signal = [torch.randn(numel, generator=g) * 0.02 for _ in weights]
    errors = {}
    for feedback in (False, True):
        buffers = [torch.zeros(numel) for _ in weights]
        applied, exact = torch.zeros(numel), torch.zeros(numel)
        g.manual_seed(1)
        for _ in range(rounds):
            grads = [s + torch.randn(numel, generator=g) for s in signal]
            exact += sum(x * w for x, w in zip(grads, weights)) / sum(weights)
            sent = [x + b for x, b in zip(grads, buffers)] if feedback else grads
            result, residuals = quantized_allreduce(codec, sent, weights)
            applied += result
            if feedback:
                buffers = residuals
        errors[feedback] = ((applied - exact).norm() / exact.norm()).item()
    # with feedback only the owners' quantization of the results and the last round's residual remain
    assert errors[True] < 0.8 * errors[False], errors
    assert errors[True] < {"int8": 0.01, "int4": 0.15}[name], errors


class ResidualAverager(Averager):
    """Commits the plain mean of one peer and reports a fixed residual; records what it was sent."""

    def __init__(self):
        self.sent: list[list[torch.Tensor]] = []
        self.plain: list[list[torch.Tensor]] = []

    def average(self, round, pseudo_grad, samples, out, base=""):
        self.sent.append(pseudo_grad.tensors())
        self.plain.append(PseudoGradient(pseudo_grad.global_params, pseudo_grad.local_params).tensors())
        for o, t in zip(out, self.sent[-1]):
            o.copy_(t)
        residual = [torch.full_like(t, 0.001 * (round + 1)) for t in out]
        return ExchangeOutcome(out, total_samples=samples, residual=residual)


@pytest.mark.timeout(120)
def test_trainer_adds_residual_to_next_pseudo_gradient_and_checkpoints_it(tmp_path):
    cfg = tiny_config(diloco={"rounds": 2, "inner_steps": 2}, swarm={"error_feedback": True},
                      checkpoint={"every": 1})
    averager = ResidualAverager()
    trainer = Trainer(cfg, averager, "p", shard=0, out_dir=tmp_path)
    trainer.train()
    assert len(averager.sent) == 2
    for a, b in zip(averager.sent[0], averager.plain[0]):
        assert torch.equal(a, b)  # nothing to feed back in the first round
    for a, b in zip(averager.sent[1], averager.plain[1]):
        assert torch.allclose(a, b + 0.001)  # round 1's residual was added
    tensors, _ = trainer.checkpointer.load_all()
    names = StateNames.of(trainer.model)  # a checkpoint names them by parameter: error_feedback.<state_dict name>
    feedback = [tensors[names.named(f"error_feedback.{i}")] for i in range(len(averager.sent[0]))]
    assert all(torch.equal(e, torch.full_like(e, 0.002)) for e in feedback)
    assert not any(k.startswith("error_feedback") for k in shared_tensors(trainer.diloco, trainer.optimizer))
    resumed = Trainer(cfg, averager, "p", shard=0, out_dir=tmp_path)
    assert resumed.state.resume()
    assert all(torch.equal(a, b) for a, b in zip(resumed.progress.error_feedback, feedback))

    off = tiny_config(diloco={"rounds": 1, "inner_steps": 2}, checkpoint={"every": 0})
    quiet = Trainer(off, ResidualAverager(), "q", shard=0, out_dir=tmp_path / "off")
    quiet.train()
    assert quiet.progress.error_feedback is None  # swarm.error_feedback defaults to off
