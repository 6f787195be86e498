"""The outer step: Nesterov SGD on the mean pseudo-gradient, with the sign convention pinned."""

import pytest
import torch

from swarm.averaging import weighted_mean
from swarm.config import OuterConfig
from swarm.diloco import DiLoCo

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
    (pg,) = diloco.pseudo_gradient()
    assert torch.equal(pg, torch.tensor([[0.25, -0.5]]))


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


def test_state_roundtrip_and_shape_check():
    model = _model([1.0, 2.0])
    diloco = DiLoCo(model, OuterConfig())
    diloco.outer_step([torch.tensor([[0.1, 0.2]])])
    other = DiLoCo(_model([0.0, 0.0]), OuterConfig())
    other.load_state_dict(diloco.state_dict())
    assert other.global_sha256() == diloco.global_sha256() and other.round == 1
    bad = diloco.state_dict()
    bad["global_params"] = [torch.zeros(3)]
    with pytest.raises(ValueError, match="shape"):
        other.load_state_dict(bad)
