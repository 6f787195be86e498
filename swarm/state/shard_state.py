"""A sharded peer's state (swarm/train/sharding.py) in and out of its ranks: what its rank 0 serves to the swarm, and a
state taken from the swarm spread over its ranks. The state travels in the canonical layout (whole tensors, the
names of swarm/state/peerstate.py), whatever K the donor and the taker have, so a peer of K ranks takes the state of a
peer of any other K, sharded or not.

Both go through whole tensors on rank 0 in a file-backed mapping (`Whole`: `torch.from_file`, shared), so that
they sit in the page cache, which the kernel may write back and evict, instead of in the process's own memory;
the ranks fill it or read it one tensor at a time (`Shards.gather`, `Shards.scatter`).

Serving (`Served`): after each commit (and after a state is taken) the ranks gather the global parameters and
the outer momentum into rank 0's copy, under a seqlock of its own (a reader that sees its version move gives up,
as with `DiLoCo.version`). A sharded peer serves no AdamW moments: a peer that takes its state starts its inner
optimizer afresh (the moments are absent from a state before a donor's first inner step too).

Taking (`incoming` then `spread`): rank 0 downloads into whole tensors checked against the canonical names and
shapes (a state that does not match is refused, naming its first tensor that does not, before a byte is
written), then every rank takes its rows of each (AdamW's step count: the same on every rank).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from swarm.state import peerstate as peer_state
from swarm.state.peerstate import TensorSpec
from swarm.train.diloco import DiLoCo
from swarm.train.sharding import Shards


class Whole:
    """fp32 tensors by name, whole, in one file-backed mapping at `path` (replaced)."""

    def __init__(self, path: Path, specs: list[TensorSpec]):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        total = sum(math.prod(s.shape) for s in specs)
        storage = torch.from_file(str(path), shared=True, size=max(1, total), dtype=torch.float32)
        self.path, self.specs, self.tensors, self.starts, at = path, list(specs), {}, {}, 0
        for s in specs:
            n = math.prod(s.shape)
            self.tensors[s.name], self.starts[s.name] = storage[at:at + n].view(s.shape), at
            at += n

    def write(self, name: str, values: torch.Tensor) -> None:
        """Tensor `name` <- `values` through the file, not the mapping: the pages stay out of this process's
        resident memory until a reader touches them (one page cache: the mapping sees the write)."""
        data = memoryview(values.detach().to("cpu", torch.float32).contiguous().numpy()).cast("B")
        with open(self.path, "r+b") as f:
            f.seek(self.starts[name] * 4)
            f.write(data)


def canonical_specs(diloco: DiLoCo, momentum: bool, adam: bool) -> list[TensorSpec]:
    """The names, dtypes and whole shapes of a shared state (swarm/state/peerstate.py order) for this peer's model."""
    shapes = diloco.layout.shapes
    specs = [TensorSpec(f"global.{i}", "float32", tuple(s)) for i, s in enumerate(shapes)]
    if momentum:
        specs += [TensorSpec(f"momentum.{i}", "float32", tuple(s)) for i, s in enumerate(shapes)]
    if adam:
        for i, s in enumerate(shapes):
            specs += [TensorSpec(f"adam.{i}.{key}", "float32", tuple(s)) for key in ("exp_avg", "exp_avg_sq")]
            specs.append(TensorSpec(f"adam.{i}.step", "float32", ()))
    return specs


def check(diloco: DiLoCo, specs: list[TensorSpec]) -> None:
    """ValueError naming the first tensor of an incoming state that is not the canonical layout's."""
    names = {s.name for s in specs}
    expected = canonical_specs(diloco, "momentum.0" in names, any(n.startswith("adam.") for n in names))
    peer_state.compare_specs(specs, expected, " (the canonical layout)")


def incoming(diloco: DiLoCo, folder: Path, specs: list[TensorSpec]) -> Whole:
    """Rank 0: whole tensors to download a state into, after `check`."""
    check(diloco, specs)
    return Whole(folder / "incoming.f32", specs)


def prepare(diloco: DiLoCo, optimizer: torch.optim.Optimizer, names: set[str]) -> dict[str, torch.Tensor]:
    """This rank's rows of each tensor of a state holding `names`, momentum and moments allocated or dropped to
    match it (as `state.destinations` does for a whole one)."""
    if "momentum.0" in names and diloco.momentum_buffers() is None:
        diloco.set_momentum([torch.zeros_like(g) for g in diloco.global_params])
    elif "momentum.0" not in names:
        diloco.set_momentum(None)
    if any(n.startswith("adam.") for n in names):
        peer_state._init_moments(optimizer)
    else:
        for p in diloco.model.parameters():
            optimizer.state.pop(p, None)
    return local_tensors(diloco, optimizer)


def local_tensors(diloco: DiLoCo, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's rows of the shared state's tensors (swarm/state/peerstate.py names and order; the moments only once
    every parameter has them), live: what its checkpoints write."""
    out = {f"global.{i}": g for i, g in enumerate(diloco.global_params)}
    for i, b in enumerate(diloco.momentum_buffers() or []):
        out[f"momentum.{i}"] = b
    states = [optimizer.state.get(p, {}) for p in diloco.model.parameters() if p.requires_grad]
    if all(all(k in st for k in peer_state.ADAM_KEYS) for st in states):
        for i, st in enumerate(states):
            for key in peer_state.ADAM_KEYS:
                t = st[key]
                out[f"adam.{i}.{key}"] = t.to_local() if hasattr(t, "to_local") else t
    return out


def placement(diloco: DiLoCo, name: str) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Where this rank's rows of the state tensor at positional `name` sit in the whole one: (offset, whole
    shape); None for a tensor every rank holds whole (a step count, rng, error feedback)."""
    kind, _, rest = name.partition(".")
    index, _, key = rest.partition(".")
    if kind not in ("global", "momentum", "adam") or not index.isdigit() or key == "step":
        return None
    shape = tuple(diloco.layout.shapes[int(index)])
    return (diloco.layout.rows(int(index))[0], *[0] * (len(shape) - 1)), shape


@torch.no_grad()
def spread(diloco: DiLoCo, optimizer: torch.optim.Optimizer, shards: Shards, names: list[str],
           whole: Optional[Whole]) -> None:
    """Every rank at once: its rows of each tensor `names` of the state rank 0 took into `whole`."""
    local = prepare(diloco, optimizer, set(names))
    for name in names:
        kind, _, rest = name.partition(".")
        index = int(rest.partition(".")[0])
        if name.endswith(".step"):  # a scalar, the same on every rank
            value = torch.zeros(1)
            if whole is not None:
                value[0] = whole.tensors[name].item()
            dist.broadcast(value, src=0, group=shards.group)
            local[name].fill_(value.item())
        else:
            shards.scatter(index, whole.tensors[name] if whole is not None else None, local[name])


class Served:
    """Rank 0's whole copy of the global parameters and outer momentum, which its state server reads."""

    def __init__(self, folder: Path):
        self.folder, self.version, self.whole = folder, 0, None

    def refresh(self, diloco: DiLoCo, shards: Shards) -> Optional[dict[str, torch.Tensor]]:
        """Every rank at once: gather what the peer holds now; the tensors to serve on rank 0, None elsewhere."""
        momentum = diloco.momentum_buffers()
        specs = canonical_specs(diloco, momentum is not None, adam=False)
        local = [*diloco.global_params, *(momentum or [])]
        self.version += 1  # odd: being rewritten
        if shards.root and (self.whole is None or self.whole.specs != specs):
            self.whole = Whole(self.folder / "served.f32", specs)
        count = len(diloco.global_params)
        for j, (spec, t) in enumerate(zip(specs, local)):
            got = shards.gather(j % count, t)
            if got is not None:
                self.whole.write(spec.name, got)
        self.version += 1
        return self.whole.tensors if shards.root else None
