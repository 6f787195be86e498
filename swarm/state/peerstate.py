"""A peer's training state as named tensors plus a small JSON header (`meta`): what a checkpoint holds and
what a newcomer downloads, one tensor at a time and straight into the receiver's own tensors.

The shared state, in this order:

    global.{i}              fp32 global parameters (the committed round's values)
    momentum.{i}            fp32 outer Nesterov momentum           (absent before the first outer step)
    adam.{i}.exp_avg        AdamW moments, fp32                     (absent before the first inner step)
    adam.{i}.exp_avg_sq
    adam.{i}.step           float32 scalar

With `inner.optimizer: adamw8bit` (bitsandbytes) the moments are `adam.{i}.state1`, `state2` (uint8, or fp32
for tensors under 4096 elements) and `absmax1`, `absmax2` (fp32, one per block of 256); its step count is an
int that bitsandbytes keeps per tensor, set from the peer's inner step (`set_optimizer_step`).

A served state (`served_tensors`) is its first two kinds only, the ones the state's hash covers
(swarm/state/statehash.py); the AdamW moments travel between a peer's own ranks and into its checkpoints, never to
another peer. A checkpoint adds this peer's own `error_feedback.{i}` (fp32) and `rng` (uint8) after them; those
are never served either. It stores every tensor by its parameter's state_dict name instead of its position
(`StateNames`: `global.model.layers.0.mlp.up_proj.weight`, `adam.model.layers.0.mlp.up_proj.weight.exp_avg`).
Every tensor received, from a file or a peer, must match a name, dtype and shape this peer expects before a byte
of it is written (`destinations`), so a state that does not fit is refused, not half-loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from swarm.tensors import dtype_of
from swarm.train.diloco import DiLoCo

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")
BNB_KEYS = ("state1", "state2", "absmax1", "absmax2")
MOMENT_KEYS = ADAM_KEYS + BNB_KEYS


def _is_8bit(optimizer: torch.optim.Optimizer) -> bool:
    return hasattr(optimizer, "init_state")  # bitsandbytes' Optimizer8bit family


def _moments(optimizer: torch.optim.Optimizer, state: dict) -> dict[str, torch.Tensor]:
    """The tensors of one parameter's optimizer state that travel, by key, in order."""
    keys = [k for k in BNB_KEYS if k in state] if _is_8bit(optimizer) else ADAM_KEYS
    return {k: state[k] for k in keys if isinstance(state.get(k), torch.Tensor)}


class StateNames:
    """Positional names (`global.3`: what travels, what `destinations` takes) and the names checkpoints store the
    same tensors by: the kind, the parameter's state_dict name, the moment key (`adam.<param>.exp_avg`)."""

    KINDS = ("global", "momentum", "adam", "error_feedback")

    def __init__(self, params: list[str]):
        self.params, self.index = list(params), {name: i for i, name in enumerate(params)}

    @classmethod
    def of(cls, model: torch.nn.Module) -> StateNames:
        """The names of `model`'s trainable parameters, in `DiLoCo.params` order."""
        return cls([name for name, p in model.named_parameters() if p.requires_grad])

    def named(self, name: str) -> str:
        kind, _, rest = name.partition(".")
        index, _, key = rest.partition(".")
        if kind not in self.KINDS or not index.isdigit() or int(index) >= len(self.params):
            return name  # rng, or a name that is no parameter's: kept as is
        return ".".join([kind, self.params[int(index)], *([key] if key else [])])

    def positional(self, name: str) -> str:
        """ValueError if `name` names a parameter this model does not have."""
        kind, _, rest = name.partition(".")
        if kind not in self.KINDS:
            return name
        param, key = rest.rpartition(".")[::2] if kind == "adam" else (rest, "")
        if param not in self.index:
            raise ValueError(f"{name}: this model has no parameter {param!r}")
        return ".".join([kind, str(self.index[param]), *([key] if key else [])])


@torch.no_grad()
def _init_moments(optimizer: torch.optim.Optimizer) -> None:
    """Allocate every parameter's optimizer state (zeros) where it has none yet."""
    for gindex, group in enumerate(optimizer.param_groups):
        for pindex, p in enumerate(group["params"]):
            if optimizer.state.get(p):
                continue
            if _is_8bit(optimizer):
                optimizer.init_state(group, p, gindex, pindex)
            else:
                optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def set_optimizer_step(optimizer: torch.optim.Optimizer, step: int) -> None:
    """bitsandbytes counts steps in a Python int per tensor (not a tensor that travels): set it to the peer's
    inner step, which it equals (the state is created at the first inner step and moves at every one)."""
    for state in optimizer.state.values():
        if isinstance(state.get("step"), int):
            state["step"] = step


@dataclass(frozen=True)
class Position:
    """Where a peer stands in its run: `round` rounds closed, `step` inner steps done in all (the learning-rate
    schedule's step), `outer_steps` outer steps committed (one per round with one fragment, F with F), `inner`
    inner steps done in the round under way. What a checkpoint, a taken state and a multi-process peer's ranks
    hand on as one value."""

    round: int
    step: int
    outer_steps: int
    inner: int = 0

    @classmethod
    def at_round(cls, round: int, step: int, outer_steps: int | None = None) -> Position:
        """At the start of a round (inner 0); `outer_steps` one per round unless given (a checkpoint written
        before fragments existed gives none)."""
        return cls(round, step, round if outer_steps is None else outer_steps)


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
    """The live tensors of the shared state, by name, in order (no copies): the served ones, then the moments."""
    out = served_tensors(diloco)
    states = [optimizer.state.get(p, {}) for p in diloco.params]
    if all(_moments(optimizer, s) for s in states):
        for i, s in enumerate(states):
            out.update({f"adam.{i}.{k}": t for k, t in _moments(optimizer, s).items()})
    return out


def served_tensors(diloco: DiLoCo) -> dict[str, torch.Tensor]:
    """The live tensors a peer serves to another, by name, in order: those the state's hash covers (no copies)."""
    out = {f"global.{i}": g for i, g in enumerate(diloco.global_params)}
    out.update({f"momentum.{i}": b for i, b in enumerate(diloco.momentum_buffers() or [])})
    return out


def canonical(name: str) -> tuple:
    """Sort key putting names in the order above (checkpoint-only names last)."""
    kind, _, rest = name.partition(".")
    index, _, key = rest.partition(".")
    order = {"global": 0, "momentum": 1, "adam": 2}.get(kind, 3)
    return (order, kind, int(index) if index.isdigit() else -1, MOMENT_KEYS.index(key) if key in MOMENT_KEYS else 0)


def _expected(diloco: DiLoCo, optimizer: torch.optim.Optimizer, momentum: bool, adam: bool) -> list[TensorSpec]:
    specs = [TensorSpec.of(f"global.{i}", g) for i, g in enumerate(diloco.global_params)]
    if momentum:
        specs += [TensorSpec.of(f"momentum.{i}", g) for i, g in enumerate(diloco.global_params)]
    if adam:
        _init_moments(optimizer)
        for i, p in enumerate(diloco.params):
            specs += [TensorSpec.of(f"adam.{i}.{k}", t) for k, t in _moments(optimizer, optimizer.state[p]).items()]
    return specs


def check_specs(diloco: DiLoCo, optimizer: torch.optim.Optimizer, specs: Iterable[TensorSpec]) -> None:
    """ValueError naming the first tensor of `specs` (a shared state, in order) this peer cannot take."""
    specs = list(specs)
    names = {s.name for s in specs}
    compare_specs(specs, _expected(diloco, optimizer, "momentum.0" in names, any(n.startswith("adam.") for n in names)))


def compare_specs(specs: list[TensorSpec], expected: list[TensorSpec], why: str = "") -> None:
    """ValueError naming the first tensor of `specs` that is not `expected`'s (`why` follows the expectation)."""
    for i, (got, want) in enumerate(zip(specs, expected)):
        if got != want:
            raise ValueError(f"tensor {i} is {got.name} {got.dtype} {list(got.shape)}, "
                             f"expected {want.name} {want.dtype} {list(want.shape)}{why}")
    if len(specs) != len(expected):
        extra = specs[len(expected)].name if len(specs) > len(expected) else expected[len(specs)].name
        raise ValueError(f"the state holds {len(specs)} tensors, expected {len(expected)} (at {extra})")


@torch.no_grad()
def destinations(diloco: DiLoCo, optimizer: torch.optim.Optimizer,
                 specs: Iterable[TensorSpec]) -> dict[str, torch.Tensor]:
    """This peer's tensors to write an incoming shared state into, after `check_specs`; outer momentum and
    AdamW state are allocated if the incoming state has them and we do not, dropped if it has not."""
    specs = list(specs)
    check_specs(diloco, optimizer, specs)
    names = {s.name for s in specs}
    if "momentum.0" in names and diloco.momentum_buffers() is None:
        diloco.set_momentum([torch.zeros_like(g) for g in diloco.global_params])
    elif "momentum.0" not in names:
        diloco.set_momentum(None)
    if not any(n.startswith("adam.") for n in names):
        for p in diloco.params:
            optimizer.state.pop(p, None)
    return shared_tensors(diloco, optimizer)
