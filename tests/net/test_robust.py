"""The owner's reducers (swarm/net/allreduce/robust.py): known inputs -> known outputs."""

import pytest
import torch

from swarm.net.allreduce import robust
from swarm.net.allreduce.robust import Rule, cap_weights, reduce_chunk, trim_count


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize("weights, cap, shares", [
    ([1, 1, 2], 1.0, [0.25, 0.25, 0.5]),          # off: plain shares
    ([1e30, 1, 1], 0.5, [0.5, 0.25, 0.25]),       # one huge claim gets the cap, the rest shares the remainder
    ([1e30, 1e30, 1, 1], 0.3, [0.3, 0.3, 0.2, 0.2]),
    ([6, 3, 1], 0.5, [0.5, 0.375, 0.125]),        # 6/10 > 0.5: cut; 3 and 1 share 0.5 as 3:1
    ([8, 1, 1, 0], 0.4, [0.4, 0.3, 0.3, 0.0]),    # a zero weight stays zero
    ([5, 1], 0.5, [0.5, 0.5]),                    # 2 members, cap 1/2: equal
    ([5, 1, 1], 0.25, [1 / 3, 1 / 3, 1 / 3]),     # 3 x 0.25 < 1: infeasible, equal
    ([2, 1, 1], 0.5, [0.5, 0.25, 0.25]),          # exactly at the cap: unchanged
])
def test_cap_weights(weights, cap, shares):
    got = cap_weights([float(w) for w in weights], cap)
    assert got == pytest.approx(shares, rel=1e-12)
    assert sum(got) == pytest.approx(1.0, rel=1e-12)


def test_cap_weights_refuses_all_zero():
    with pytest.raises(ValueError):
        cap_weights([0.0, 0.0], 0.5)


@pytest.mark.parametrize("n, trim", [(1, 0), (2, 0), (3, 1), (4, 1), (9, 1), (10, 2), (15, 3)])
def test_trim_count(n, trim):
    assert trim_count(n) == trim


CASES = [
    # (name, xs, weights, rule, expected)
    ("mean", [t(1, 2), t(3, 4), t(5, 0)], [1, 1, 2], Rule(), t(3.5, 1.5)),
    ("mean skips weight 0", [t(1, 2), t(1e6, 1e6), t(3, 4)], [1, 0, 1], Rule(), t(2, 3)),
    ("trimmed of 3 is the median", [t(1, -1e6), t(1e6, 2), t(3, 4)], [1, 1, 1], Rule("trimmed_mean"), t(3, 2)),
    ("trimmed keeps each value's weight", [t(0, 0), t(1, 1), t(2, 2), t(3, 3)], [1, 3, 1, 1],
     Rule("trimmed_mean"), t(1.25, 1.25)),  # drop 0 and 3: (1*3 + 2*1) / 4
    ("trimmed of 2 is the mean", [t(1), t(3)], [1, 1], Rule("trimmed_mean"), t(2)),
    # norms 5, 10, 5e6: lower median 10 (of the three), bound 2 x 10 = 20: the huge one becomes (12, 16)
    ("clip then mean", [t(3, 4), t(6, 8), t(3e6, 4e6)], [1, 1, 1], Rule("mean", 2.0), t(7, 28 / 3)),
    ("clip leaves honest ones", [t(3, 4), t(6, 8), t(9, 12)], [1, 1, 1], Rule("mean", 4.0), t(6, 8)),
    ("centered clip of identical values", [t(1, 1), t(1, 1), t(1, 1)], [1, 1, 1], Rule("centered_clip"), t(1, 1)),
]


@pytest.mark.parametrize("name, xs, weights, rule, expected", CASES, ids=[c[0] for c in CASES])
def test_reduce_chunk_table(name, xs, weights, rule, expected):
    got = reduce_chunk(xs, [float(w) for w in weights], rule)
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6), got


def test_centered_clip_bounds_one_outlier():
    """Honest members at 0 and 2, one at 1e6: the outlier moves the result by at most tau / 3 per iteration
    (here not at all: its clipped pull cancels the honest one), the mean by 3e5."""
    xs = [t(0.0), t(2.0), t(1e6)]
    got = reduce_chunk(xs, [1.0, 1.0, 1.0], Rule("centered_clip"))
    # start v = median 2; distances 2, 0, ~1e6 -> tau = 2; iteration: (clip(-2) + 0 + clip(1e6-2)) / 3 = 0
    assert got.item() == pytest.approx(2.0)
    plain = reduce_chunk(xs, [1.0, 1.0, 1.0], Rule("mean"))
    assert plain.item() > 3e5


def test_centered_clip_hand_computed():
    """v0 = median (1, 0); distances 1, 0, 10 -> tau = 1. Iteration 1: d = (-1,0),(0,0),(10,0) clipped to
    (-1,0),(0,0),(1,0): step 0 -> v stays (1, 0), and so on: a fixed point."""
    xs = [t(0, 0), t(1, 0), t(11, 0)]
    got = reduce_chunk(xs, [1.0, 1.0, 1.0], Rule("centered_clip"))
    assert torch.equal(got, t(1, 0))


def test_weighted_mean_is_bit_identical_to_a_fixed_recipe():
    """One IEEE operation at a time in member order: the same bits an auditor on another CPU computes."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1000, generator=g) for _ in range(4)]
    ws = [0.1, 0.2, 0.3, 0.4]
    acc = torch.zeros(1000)
    for x, w in zip(xs, ws):
        acc = acc + x * torch.tensor(w, dtype=torch.float32)
    assert torch.equal(reduce_chunk(xs, ws, Rule()), acc / torch.tensor(1.0))


def test_stable_rounds_scalars():
    assert robust.stable(1.23456789e-3) == 1.234568e-3
    assert robust.stable(float("inf")) == float("inf")


@pytest.mark.parametrize("samples, named", [
    ({"a": 100, "b": 120, "c": 10**18}, ["c"]),          # the weight attack: 1e18 beside 100s
    ({"a": 100, "b": 120, "c": 100 * 100}, []),          # exactly OUTSIZED x the median: not named
    ({"a": 100, "b": 100 * 100 + 1}, ["b"]),             # two members: the lower median is the smaller
    ({"a": 0, "b": 0, "c": 10**18}, []),                  # a median of 0 names nobody
    ({}, []),
])
def test_outsized_names_claims_over_the_median(samples, named):
    assert robust.outsized(samples) == named


def reference_trimmed_mean(xs, weights):
    """The definition, by a stable sort of each coordinate's values."""
    n, t = len(xs), trim_count(len(xs))
    values, order = torch.sort(torch.stack(xs), dim=0, stable=True)
    w = torch.tensor(weights, dtype=torch.float64)[order]
    kept = slice(t, n - t)
    return (values[kept].double() * w[kept]).sum(0) / w[kept].sum(0)


@pytest.mark.parametrize("n", [3, 4, 5, 8, 10, 16, 17])
@pytest.mark.parametrize("equal", [True, False])
def test_trimmed_mean_without_a_sort_is_the_sorted_definition(n, equal):
    g = torch.Generator().manual_seed(n)
    xs = [torch.randint(-3, 4, (5000,), generator=g).float() for _ in range(n)]  # many ties
    xs[0][:10] = 1e30  # an outlier, trimmed
    weights = [1.0] * n if equal else [float(i % 3 + 1) for i in range(n)]
    got = robust.trimmed_mean(xs, weights)
    assert torch.allclose(got.double(), reference_trimmed_mean(xs, weights), rtol=1e-6, atol=1e-6)
