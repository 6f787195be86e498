"""A peer's training state as named tensors plus a small JSON header (`meta`): what a checkpoint holds and
what a newcomer downloads, one tensor at a time and straight into the receiver's own tensors.

The shared state, in this order:

    global.{i}              fp32 global parameters (the committed round's values)
    momentum.{i}            fp32 outer Nesterov momentum           (absent before the first outer step)
    adam.{i}.exp_avg        AdamW moments, in the model's dtype     (absent before the first inner step)
    adam.{i}.exp_avg_sq
    adam.{i}.step           float32 scalar

A checkpoint adds this peer's own `error_feedback.{i}` (fp32) and `rng` (uint8) after them; those are never
served. Every tensor received, from a file or a peer, must match a name, dtype and shape this peer expects
before a byte of it is written (`destinations`), so a state that does not fit is refused, not half-loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from swarm.diloco import DiLoCo
from swarm.tensors import dtype_of

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch dtype without the prefix: "float32", "bfloat16", "uint8"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty(0, dtype=dtype_of(self.dtype)).element_size()

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorSpec:
        return cls(name, str(t.dtype).removeprefix("torch."), tuple(t.shape))

    def to_list(self) -> list:
        return [self.name, self.dtype, list(self.shape)]

    @classmethod
    def from_list(cls, item: object) -> TensorSpec:
        """From `to_list()` output received from elsewhere; ValueError if malformed."""
        if not (isinstance(item, (list, tuple)) and len(item) == 3 and isinstance(item[0], str)
                and isinstance(item[1], str) and isinstance(item[2], (list, tuple))
                and all(isinstance(d, int) and d >= 0 for d in item[2])):
            raise ValueError(f"malformed tensor entry {str(item)[:100]}")
        return cls(item[0], item[1], tuple(item[2]))


def shared_tensors(diloco: DiLoCo, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The live tensors of the shared state, by name, in order (no copies)."""
    out = {f"global.{i}": g for i, g in enumerate(diloco.global_params)}
    momentum = diloco.momentum_buffers()
    if momentum is not None:
        out.update({f"momentum.{i}": b for i, b in enumerate(momentum)})
    states = [optimizer.state.get(p, {}) for p in diloco.params]
    if all(all(k in s for k in ADAM_KEYS) for s in states):
        for i, s in enumerate(states):
            out.update({f"adam.{i}.{k}": s[k] for k in ADAM_KEYS})
    return out


def canonical(name: str) -> tuple:
    """Sort key putting names in the order above (checkpoint-only names last)."""
    kind, _, rest = name.partition(".")
    index, _, key = rest.partition(".")
    order = {"global": 0, "momentum": 1, "adam": 2}.get(kind, 3)
    return (order, kind, int(index) if index.isdigit() else -1, ADAM_KEYS.index(key) if key in ADAM_KEYS else 0)


def _expected(diloco: DiLoCo, momentum: bool, adam: bool) -> list[TensorSpec]:
    specs = [TensorSpec.of(f"global.{i}", g) for i, g in enumerate(diloco.global_params)]
    if momentum:
        specs += [TensorSpec.of(f"momentum.{i}", g) for i, g in enumerate(diloco.global_params)]
    if adam:
        for i, p in enumerate(diloco.params):
            specs += [TensorSpec.of(f"adam.{i}.exp_avg", p), TensorSpec.of(f"adam.{i}.exp_avg_sq", p),
                      TensorSpec(f"adam.{i}.step", "float32", ())]
    return specs


def check_specs(diloco: DiLoCo, specs: Iterable[TensorSpec]) -> None:
    """ValueError naming the first tensor of `specs` (a shared state, in order) this peer cannot take."""
    specs = list(specs)
    names = {s.name for s in specs}
    expected = _expected(diloco, "momentum.0" in names, "adam.0.exp_avg" in names)
    for i, (got, want) in enumerate(zip(specs, expected)):
        if got != want:
            raise ValueError(f"tensor {i} is {got.name} {got.dtype} {list(got.shape)}, "
                             f"expected {want.name} {want.dtype} {list(want.shape)}")
    if len(specs) != len(expected):
        extra = specs[len(expected)].name if len(specs) > len(expected) else expected[len(specs)].name
        raise ValueError(f"the state holds {len(specs)} tensors, expected {len(expected)} (at {extra})")


@torch.no_grad()
def destinations(diloco: DiLoCo, optimizer: torch.optim.Optimizer,
                 specs: Iterable[TensorSpec]) -> dict[str, torch.Tensor]:
    """This peer's tensors to write an incoming shared state into, after `check_specs`; outer momentum and
    AdamW state are allocated if the incoming state has them and we do not, dropped if it has not."""
    specs = list(specs)
    check_specs(diloco, specs)
    names = {s.name for s in specs}
    if "momentum.0" in names and diloco.momentum_buffers() is None:
        diloco.set_momentum([torch.zeros_like(g) for g in diloco.global_params])
    elif "momentum.0" not in names:
        diloco.set_momentum(None)
    for p in diloco.params:
        if "adam.0.exp_avg" not in names:
            optimizer.state.pop(p, None)
        elif not all(k in optimizer.state.get(p, {}) for k in ADAM_KEYS):
            optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}
    return shared_tensors(diloco, optimizer)

