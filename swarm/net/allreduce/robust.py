"""Bounded influence for the all-reduce: how a part's owner turns n contributions into one average.

Pure functions over a list of 1-D fp32 tensors (one per member, in member order) and their weights; the
owner of a part calls `reduce_chunk` once per chunk, encodes the result once and sends the same bytes to
every member, so every member ends with the same bits whatever the rule. An auditor (`audit.py`) recomputes
the same function on another machine and must get the same bytes, so every step is chosen to be exact
there too:

- element-wise work is one IEEE operation at a time (`x * w`, then `acc + that`; never a fused
  multiply-add whose use depends on the CPU's vector width), in member order, or a sort (exact);
- the few scalars that come out of a reduction over elements (a chunk's norm, whose summation order does
  depend on the vector width) are rounded to 7 significant digits (`stable`) before they are used, so a
  difference in their last bits almost never changes what follows.

The steps (`SwarmConfig`: max_weight_share, clip_norm_ratio, aggregation; on by default at 0.5, 4 and
trimmed_mean, each can be turned off, and a `Rule()` made here without arguments is the plain mean):

1. `cap_weights` (once per group, from the weights every member agreed on in matchmaking): no member's
   share of the total weight exceeds `max_weight_share` (water-filling). A member claiming a weight of
   1e30 gets at most that share instead of the whole average.
2. `clip_norms` (per chunk): each member's chunk is scaled down to at most `clip_norm_ratio` times the
   (lower) median of the members' chunk norms. Per chunk, because an owner never holds a whole part: it
   reads a few chunks at a time (`groupstate.WINDOW`). Bounding every chunk bounds the whole
   contribution too: its norm is at most ratio x sqrt(sum over chunks of the median chunk norm^2).
3. the aggregation, per chunk: `mean` (the weighted mean), `trimmed_mean` (coordinate-wise: drop the
   `trim_count` lowest and highest values, weighted mean of the rest) or `centered_clip` (Karimireddy et
   al. 2021, as used by BTARD, Gorbunov et al. 2021).

Members with weight 0 take no part in steps 2 and 3 (they count for nothing in the mean either).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

TRIM_FRACTION = 0.2
"""trimmed_mean drops floor(n x 0.2) values at each end of every coordinate, at least 1 once n >= 3: one
hostile member among 3 is always dropped; 2 among 10."""

CC_ITERATIONS = 3
"""centered_clip: fixed point iterations from the coordinate-wise median. Started that close to the
honest mean, 1-3 iterations suffice (Karimireddy et al. 2021, Thm. 3); a fixed count keeps every
member's computation identical."""

CC_TAU_FACTOR = 1.0
"""centered_clip: tau = this x the (lower) median of the members' distances to the starting point. Scale
free (no config key to tune per model): a hostile member moves the result by at most tau x its weight
share per iteration, honest members near the median are barely clipped."""


@dataclass(frozen=True)
class Rule:
    """How a group reduces, the same on every member (these SwarmConfig keys are in the run's fingerprint)."""

    aggregation: str = "mean"
    clip_norm_ratio: float = 0.0
    max_weight_share: float = 1.0
    verify: bool = False  # swarm.verify_parts: members audit the owners (audit.py)

    @classmethod
    def of(cls, cfg) -> Rule:
        """From a SwarmConfig."""
        return cls(cfg.aggregation, cfg.clip_norm_ratio, cfg.max_weight_share, cfg.verify_parts)


def stable(x: float) -> float:
    """`x` rounded to 7 significant digits: what a sum over a chunk's elements computes alike on CPUs that
    sum in another order (a vector width of 8 or 16 lanes) in all but ~1e-7 of the cases."""
    return float(f"{x:.6e}") if math.isfinite(x) else x


def norm(x: torch.Tensor) -> float:
    return stable(float(torch.linalg.vector_norm(x, dtype=torch.float64)))


def lower_median(values: Sequence[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def cap_weights(weights: Sequence[float], cap: float) -> list[float]:
    """Each member's share of the total (summing to 1) with no share above `cap`: the shares above it are cut
    to `cap` and the mass they lose goes to the others in proportion to their weights (water-filling).
    Infeasible when fewer than 1/cap members have weight > 0: then those share equally."""
    positive = [i for i, w in enumerate(weights) if w > 0]
    if not positive:
        raise ValueError("no member has a weight > 0")
    if cap >= 1.0:
        total = math.fsum(weights)
        return [w / total for w in weights]
    if len(positive) * cap <= 1.0:
        return [1.0 / len(positive) if w > 0 else 0.0 for w in weights]
    capped: set[int] = set()
    while True:
        free = [i for i in positive if i not in capped]
        mass, free_total = 1.0 - cap * len(capped), math.fsum(weights[i] for i in free)
        over = {i for i in free if weights[i] / free_total * mass > cap}
        if not over:
            break
        capped |= over
    return [cap if i in capped else (w / free_total * mass if w > 0 else 0.0) for i, w in enumerate(weights)]


OUTSIZED = 100
"""A member claiming more than this many times the lower median of its group's samples is named (`outsized`)."""


def outsized(samples: dict[str, int]) -> list[str]:
    """The members (peer id -> samples claimed) whose weight is over OUTSIZED times the group's lower median. Their
    share is capped anyway (swarm.max_weight_share, allreduce/robust.py); naming them lets the events say who
    claimed it. A median of 0 (members that trained nothing) names nobody."""
    median = sorted(samples.values())[(len(samples) - 1) // 2] if samples else 0
    return sorted(p for p, n in samples.items() if median > 0 and n > OUTSIZED * median)


def clip_norms(xs: Sequence[torch.Tensor], ratio: float) -> list[torch.Tensor]:
    """Each of `xs` scaled down to norm <= ratio x the lower median of their norms (unchanged if below)."""
    norms = [norm(x) for x in xs]
    bound = stable(ratio * lower_median(norms))
    return [x * (bound / n) if n > bound else x for x, n in zip(xs, norms)]


def weighted_mean(xs: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    acc = torch.zeros_like(xs[0])
    for x, w in zip(xs, weights):
        acc.add_(x * w)
    return acc.div_(math.fsum(weights))


def trim_count(n: int) -> int:
    return max(1, math.floor(n * TRIM_FRACTION)) if n >= 3 else 0


def trimmed_mean(xs: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Coordinate-wise: sort the n values (stable: ties keep member order), drop `trim_count(n)` at each
    end, weighted mean of the rest with each value's own member's weight.

    Computed without a sort along the members (torch sorts a dim of 4 at ~140 ms per 1M-element chunk, which
    made it most of a 4-peer all-reduce's CPU): with equal weights (the usual case: members that trained
    alike) the kept order statistics come from a network of elementwise min/max, 19-35x faster for n <= 8;
    otherwise each member's rank comes from comparisons with the others, 3x faster. Both up to SMALL members;
    a bigger group sorts."""
    n, t = len(xs), trim_count(len(xs))
    if t == 0:
        return weighted_mean(xs, weights)
    if n > SMALL:
        values, order = torch.sort(torch.stack(list(xs)), dim=0, stable=True)
        w = torch.tensor(list(weights), dtype=torch.float32)[order]
        acc, den = torch.zeros_like(xs[0]), torch.zeros_like(xs[0])
        for r in range(t, n - t):
            acc.add_(values[r] * w[r])
            den.add_(w[r])
        return acc.div_(den)
    if len(set(weights)) == 1:
        kept = order_statistics(xs)[t:n - t]
        acc = kept[0].clone()
        for x in kept[1:]:
            acc.add_(x)
        return acc.div_(n - 2 * t)
    acc, den = torch.zeros_like(xs[0]), torch.zeros_like(xs[0])
    for x, w, rank in zip(xs, weights, stable_ranks(xs)):
        keep = (rank >= t) & (rank < n - t)
        acc.add_(torch.where(keep, x, 0.0), alpha=w)
        den.add_(keep, alpha=w)
    return acc.div_(den)


SMALL = 16  # members up to which trimmed_mean avoids torch.sort


def order_statistics(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The coordinate-wise order statistics of `xs`, lowest first (odd-even transposition network)."""
    v = list(xs)
    for step in range(len(v)):
        for i in range(step % 2, len(v) - 1, 2):
            v[i], v[i + 1] = torch.minimum(v[i], v[i + 1]), torch.maximum(v[i], v[i + 1])
    return v


def stable_ranks(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each member's coordinate-wise position in a stable ascending sort: the values below it, and the equal
    values of members before it."""
    ranks = []
    for i, x in enumerate(xs):
        rank = torch.zeros(x.shape, dtype=torch.uint8)
        for j, y in enumerate(xs):
            if j != i:
                rank.add_(torch.le(y, x) if j < i else torch.lt(y, x))
        ranks.append(rank)
    return ranks


def coordinate_median(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The lower median of every coordinate (a value one of the members sent)."""
    return torch.sort(torch.stack(list(xs)), dim=0).values[(len(xs) - 1) // 2].clone()


def centered_clip(xs: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """v <- v + sum_i w_i clip(x_i - v, tau) / sum_i w_i, CC_ITERATIONS times from the coordinate-wise
    median, where clip(d, tau) = d x min(1, tau / |d|) and tau = CC_TAU_FACTOR x the lower median of
    |x_i - median|."""
    v = coordinate_median(xs)
    tau = stable(CC_TAU_FACTOR * lower_median([norm(x - v) for x in xs]))
    if tau == 0.0:
        return v  # most members sent the same values: that is the answer
    total = math.fsum(weights)
    for _ in range(CC_ITERATIONS):
        step = torch.zeros_like(v)
        for x, w in zip(xs, weights):
            d = x - v
            scale = min(1.0, tau / max(norm(d), 1e-300))
            step.add_(d * (w * scale))
        v = v + step.div_(total)
    return v


AGGREGATIONS = {"mean": weighted_mean, "trimmed_mean": trimmed_mean, "centered_clip": centered_clip}


def reduce_chunk(xs: Sequence[torch.Tensor], weights: Sequence[float], rule: Rule) -> torch.Tensor:
    """The owner's average of one chunk: `xs` in member order, `weights` the members' (capped) shares."""
    keep = [i for i, w in enumerate(weights) if w > 0]
    if not keep:
        raise ValueError("no member has a weight > 0")
    xs, weights = [xs[i] for i in keep], [weights[i] for i in keep]
    if rule.clip_norm_ratio > 0:
        xs = clip_norms(xs, rule.clip_norm_ratio)
    return AGGREGATIONS[rule.aggregation](xs, weights)
