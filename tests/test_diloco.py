"""The outer step: Nesterov SGD on the mean pseudo-gradient, with the sign convention pinned."""

import pytest
import torch

from swarm.config import OuterConfig
from swarm.train.averaging import weighted_mean
from swarm.train.diloco import DiLoCo

pytestmark = pytest.mark.timeout(30)


def _model(values):
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([values]))
    return model


def test_pseudo_gradient_is_global_minus_local():
    model = _model([1.0, 2.0])
    diloco = DiLoCo(model, OuterConfig())
    with torch.no_grad():
        model.weight.sub_(torch.tensor([[0.25, -0.5]]))
    (pg,) = diloco.pseudo_gradient().tensors()
    assert torch.equal(pg, torch.tensor([[0.25, -0.5]]))
    assert torch.equal(diloco.pseudo_gradient().read(0, 1, 2), torch.tensor([-0.5]))  # a slice, never the whole
    residual = [torch.tensor([[0.5, 0.5]])]
    assert torch.equal(diloco.pseudo_gradient(residual).tensors()[0], torch.tensor([[0.75, 0.0]]))


def test_outer_lr_one_without_momentum_is_fedavg():
    model = _model([1.0, 2.0])
    diloco = DiLoCo(model, OuterConfig(lr=1.0, momentum=0.0))
    locals_ = [torch.tensor([[0.0, 3.0]]), torch.tensor([[2.0, 1.0]])]
    pgs = [[diloco.global_params[0] - local] for local in locals_]
    diloco.outer_step(weighted_mean([(pg, 1.0) for pg in pgs]))
    assert torch.allclose(diloco.global_params[0], torch.tensor([[1.0, 2.0]]))  # the mean of the locals
    assert torch.equal(model.weight, diloco.global_params[0])  # local reset to global


def test_outer_step_equals_torch_nesterov_sgd_on_the_mean():
    torch.manual_seed(0)
    shapes = [(4, 3), (5,)]
    start = [torch.randn(s) for s in shapes]
    model = torch.nn.Module()
    model.a, model.b = (torch.nn.Parameter(t.clone()) for t in start)
    diloco = DiLoCo(model, OuterConfig(lr=0.7, momentum=0.9, nesterov=True))

    reference = [torch.nn.Parameter(t.clone()) for t in start]
    ref_opt = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(4):
        workers = [[torch.randn(s) for s in shapes] for _ in range(3)]
        weights = [1.0, 2.0, 5.0]
        avg = weighted_mean(list(zip(workers, weights)))
        diloco.outer_step(avg)
        mean = [sum(w * g[i] for g, w in zip(workers, weights)) / sum(weights) for i in range(len(shapes))]
        for p, g in zip(reference, mean):
            p.grad = g
        ref_opt.step()
    for ours, ref in zip(diloco.global_params, reference):
        assert torch.allclose(ours, ref.detach(), atol=1e-6, rtol=0)
    assert diloco.round == 4


@pytest.mark.parametrize("momentum, nesterov", [(0.9, True), (0.9, False), (0.0, False)])
def test_own_outer_step_is_the_outer_step_a_peer_would_take_alone(momentum, nesterov):
    """Where a delayed exchange resumes the local model from (swarm/train/overlap.py): the global parameters after
    an outer step on this peer's own pseudo-gradient, computed without changing anything; at the first outer step
    (no momentum yet) and at a later one."""
    diloco = DiLoCo(_model([1.0, 2.0]), OuterConfig(lr=0.7, momentum=momentum, nesterov=nesterov))
    for local, average in (([[0.5, 2.5]], [[0.25, -0.75]]), ([[1.5, 0.5]], [[-0.5, 0.25]])):
        local = torch.tensor(local)
        before = [g.clone() for g in diloco.global_params]
        own = diloco.own_outer_step(0, diloco.global_params[0] - local)
        assert torch.equal(diloco.global_params[0], before[0])  # nothing changed
        buffers = [b.clone() for b in diloco.momentum_buffers() or []]
        reference = torch.optim.SGD([torch.nn.Parameter(before[0].clone())], lr=0.7, momentum=momentum,
                                    nesterov=nesterov)
        if buffers:
            reference.state[reference.param_groups[0]["params"][0]] = {"momentum_buffer": buffers[0]}
        (param,) = reference.param_groups[0]["params"]
        param.grad = before[0] - local
        reference.step()
        assert torch.allclose(own, param.detach(), atol=1e-6, rtol=0)
        diloco.outer_step([torch.tensor(average)])


def test_a_solo_peer_s_average_is_read_at_the_outer_step_and_never_copied():
    """A peer alone averages its own pseudo-gradient: its buffers hold nothing (no copy of the model), and the outer
    step reads the pseudo-gradient tensor by tensor, each before it is stepped: the same outer step as from a copy."""
    from swarm.train.averaging import SoloAverager

    models = [torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    dilocos = [DiLoCo(m, OuterConfig(lr=0.7, momentum=0.9)) for m in models]
    for _ in range(2):
        for m in models:
            with torch.no_grad():
                for p in m.parameters():
                    p.mul_(0.5).add_(0.25)
        shapes = [g.shape for g in dilocos[0].global_params]
        solo = SoloAverager()
        out = solo.result_buffers(shapes)
        averaged = solo.average(0, dilocos[0].pseudo_gradient(), 1, out).averaged
        assert averaged is out and out.tensors == []  # nothing copied
        dilocos[0].outer_step(averaged)
        dilocos[1].outer_step(dilocos[1].pseudo_gradient().tensors())
        assert all(torch.equal(a, b) for a, b in zip(dilocos[0].global_params, dilocos[1].global_params))
        assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))


def test_outer_step_leaves_the_averaged_buffers_intact_and_bumps_the_version():
    """Groupmates may still read the average from us after our outer step (all-reduce repairs)."""
    model = _model([1.0, 2.0])
    diloco = DiLoCo(model, OuterConfig())
    for _ in range(2):  # the second step has momentum: torch's multi-tensor Nesterov would overwrite .grad
        averaged = [torch.tensor([[0.1, 0.2]])]
        before, version = averaged[0].clone(), diloco.version
        diloco.outer_step(averaged)
        assert torch.equal(averaged[0], before) and diloco.global_params[0].grad is None
        assert diloco.version == version + 2 and diloco.momentum_buffers() is not None


def test_shared_state_round_trips_by_name_and_refuses_another_shape():
    from swarm.state.peerstate import TensorSpec, destinations, shared_tensors

    donor, opt = DiLoCo(_model([1.0, 2.0]), OuterConfig()), None
    opt = torch.optim.AdamW(donor.model.parameters())
    donor.model(torch.ones(1, 2)).sum().backward()
    opt.step()
    donor.outer_step([torch.tensor([[0.1, 0.2]])])
    sent = shared_tensors(donor, opt)
    assert list(sent) == ["global.0", "momentum.0", "adam.0.exp_avg", "adam.0.exp_avg_sq", "adam.0.step"]
    other = DiLoCo(_model([0.0, 0.0]), OuterConfig())
    other_opt = torch.optim.AdamW(other.model.parameters())
    targets = destinations(other, other_opt, [TensorSpec.of(k, t) for k, t in sent.items()])
    for name, t in sent.items():
        targets[name].copy_(t)
    other.round = donor.round  # the position a taker's intake sets, which the hash covers too
    assert other.global_sha256() == donor.global_sha256()
    assert torch.equal(other_opt.state[other.params[0]]["exp_avg"], opt.state[donor.params[0]]["exp_avg"])
    with pytest.raises(ValueError, match="expected global.0"):
        destinations(other, other_opt, [TensorSpec("global.0", "float32", (3,))])


def test_the_state_hash_covers_the_momentum_and_the_rounds_and_is_taken_once_per_change(monkeypatch):
    """The hash a peer commits is of everything a downloaded state sets alike on every peer (swarm/state/statehash.py):
    a donor that changed only a momentum buffer, or only the count of rounds closed, serves another hash. The
    tensors are read once per change, however often the hash is asked for."""
    import swarm.train.diloco

    digests = []
    real = swarm.train.diloco.tensors_digest
    monkeypatch.setattr(swarm.train.diloco, "tensors_digest", lambda tensors: digests.append(1) or real(tensors))
    diloco = DiLoCo(_model([1.0, 2.0]), OuterConfig())
    before_momentum = diloco.global_sha256()
    for _ in range(2):
        diloco.outer_step([torch.tensor([[0.1, 0.2]])])
    committed, params = diloco.global_sha256(), [g.clone() for g in diloco.global_params]
    assert diloco.momentum_buffers() is not None and committed != before_momentum
    assert [diloco.global_sha256() for _ in range(3)] == [committed] * 3 and len(digests) == 2  # kept

    with diloco.changing():
        diloco.momentum_buffers()[0][0, 0] += 1e-3  # the momentum alone, as a poisoning donor would serve it
    assert all(torch.equal(g, p) for g, p in zip(diloco.global_params, params))
    assert diloco.global_sha256() != committed and len(digests) == 3
    with diloco.changing():
        diloco.momentum_buffers()[0][0, 0] -= 1e-3
    assert diloco.global_sha256() == committed
    diloco.round += 1  # another count of rounds closed on the same tensors
    assert diloco.global_sha256() != committed and len(digests) == 4
