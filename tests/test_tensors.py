"""The small tensor helpers: swapping values in place for an eval of the global parameters."""

import pytest
import torch

from swarm.tensors import swapped


def test_swapped_trades_values_for_the_body_and_back_exactly_even_when_it_raises():
    torch.manual_seed(0)
    a = [torch.randn(5, 3), torch.randn(7)[1:5]]  # a view, as a sharded peer's rows are
    b = [torch.randn(5, 3), torch.randn(4)]
    a0, b0 = [t.clone() for t in a], [t.clone() for t in b]
    with swapped(a, b):
        assert all(torch.equal(x, y) for x, y in zip(a, b0)) and all(torch.equal(x, y) for x, y in zip(b, a0))
    assert all(torch.equal(x, y) for x, y in zip(a + b, a0 + b0))
    with pytest.raises(RuntimeError, match="the eval failed"):
        with swapped(a, b):
            raise RuntimeError("the eval failed")
    assert all(torch.equal(x, y) for x, y in zip(a + b, a0 + b0))


@pytest.mark.parametrize("other", [torch.zeros(4, dtype=torch.bfloat16), torch.zeros(5)])
def test_swapped_refuses_pairs_a_swap_would_round_or_cut_and_changes_nothing(other):
    a, b = [torch.ones(4), torch.ones(4)], [torch.full((4,), 2.0), other]
    with pytest.raises(ValueError, match="cannot swap"):
        with swapped(a, b):
            pass
    assert torch.equal(a[0], torch.ones(4)) and torch.equal(b[0], torch.full((4,), 2.0))
