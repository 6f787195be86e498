"""The DiLoCo outer step, attached at the optimizer boundary (like torchft's `DiLoCo` wrapper).

`DiLoCo` keeps the global parameters (fp32, on `global_device`) and the outer optimizer, SGD with
Nesterov momentum. One round, seen from a peer:

    pseudo_grad = diloco.pseudo_gradient()           # global - local, read lazily after H inner steps
    averaged = diloco.outer_grads()                  # fp32 buffers the all-reduce writes the mean into
    averager.average(pseudo_grad, averaged)          # weighted mean over the group
    diloco.outer_step(averaged)                      # global <- outer SGD step; local <- global

Sign convention: the pseudo-gradient is `global - local`, so it points where a gradient points (the
local model moved *against* it). With outer lr 1 and no momentum the outer step lands exactly on the
(averaged) local parameters: that is FedAvg, and a test pins it.

Memory: the pseudo-gradient is never materialized (the all-reduce reads it chunk by chunk), and the
average is read one tensor at a time (`Buffers.each`: a networked peer keeps it in the wire's bytes until
then, allreduce/layout.py `EncodedAverage`), each the outer optimizer's `.grad` for its own step only. SGD
runs per tensor (`foreach=False`): the multi-tensor path would allocate a vector-sized temporary and
overwrite `.grad`, which groupmates may still be reading from us (allreduce.py repairs).

`version` is a seqlock for readers on other threads (the state server): odd while the global parameters
or the outer momentum are being changed, and different after every change.

`global_sha256()` is the state's hash (swarm/state/statehash.py: the global parameters, the outer momentum and the
count of rounds closed), what a peer records for each outer step it commits. Its digest of the tensors is taken
once per change and kept until the next (`changing()` drops it), so asking again costs nothing.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from swarm.config import OuterConfig
from swarm.state.statehash import state_sha256, tensors_digest
from swarm.tensors import Buffers, all_finite
from swarm.train.sharding import Layout, Shards, local_params


class PseudoGradient:
    """global - local (+ an error-feedback residual) in fp32, read slice by slice: never one whole vector."""

    def __init__(self, global_params: Sequence[torch.Tensor], local_params: Sequence[torch.Tensor],
                 residual: Optional[Sequence[torch.Tensor]] = None):
        self.global_params, self.local_params, self.residual = global_params, local_params, residual
        self.shapes = [g.shape for g in global_params]

    @torch.no_grad()
    def read(self, index: int, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of flattened tensor `index`, as a fresh fp32 CPU tensor."""
        g = self.global_params[index].view(-1)[start:end]
        out = g - self.local_params[index].detach().view(-1)[start:end].to(g.device, torch.float32)
        if self.residual is not None:
            out += self.residual[index].view(-1)[start:end].to(g.device)
        return out.cpu()

    def tensors(self) -> list[torch.Tensor]:
        """The whole pseudo-gradient, materialized (for in-memory averagers, tests and tensor dumps)."""
        return [self.read(i, 0, g.numel()).view(g.shape) for i, g in enumerate(self.global_params)]

    def is_finite(self) -> bool:
        """The local model has no NaN/Inf (the global parameters only ever take finite averages)."""
        return all(all_finite(t) for t in self.local_params)


class Kept(PseudoGradient):
    """A pseudo-gradient taken when a delayed exchange starts (global - local then, one tensor per parameter),
    kept while the local model trains on, plus an error-feedback residual; read slice by slice."""

    def __init__(self, taken: Sequence[torch.Tensor], residual: Optional[Sequence[torch.Tensor]] = None):
        self.taken, self.residual = taken, residual
        self.shapes = [t.shape for t in taken]

    @torch.no_grad()
    def read(self, index: int, start: int, end: int) -> torch.Tensor:
        out = self.taken[index].view(-1)[start:end].to("cpu", torch.float32, copy=True)
        if self.residual is not None:
            out += self.residual[index].view(-1)[start:end].to("cpu")
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [self.read(i, 0, t.numel()).view(t.shape) for i, t in enumerate(self.taken)]

    def is_finite(self) -> bool:
        return all(all_finite(t) for t in self.taken)


def take(global_params: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
         dtype: torch.dtype) -> list[torch.Tensor]:
    """global - local per tensor, kept in `dtype` (fp32 for a tensor whose values `dtype` cannot hold)."""
    taken = []
    for g, p in zip(global_params, params):
        d = g - p.detach().to(g.device, torch.float32)
        small = d.to(dtype)
        taken.append(small if dtype == torch.float32 or all_finite(small) or not all_finite(d) else d)
    return taken


class OnNode(PseudoGradient):
    """A sharded peer's pseudo-gradient as its rank 0 reads it: every rank's rows in the node-local file `values`
    (swarm/train/sharding.py), plus rank 0's whole error-feedback `residual`; `finite`: every rank's rows were."""

    def __init__(self, values: Buffers, residual: Optional[Sequence[torch.Tensor]], finite: bool):
        self.values, self.residual, self.finite = values, residual, finite
        self.shapes = list(values.shapes)

    def read(self, index: int, start: int, end: int) -> torch.Tensor:
        out = self.values.read(index, start, end)
        if self.residual is not None:
            out += self.residual[index].reshape(-1)[start:end].to("cpu", torch.float32)
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [self.read(i, 0, self.values.numel(i)).view(s) for i, s in enumerate(self.shapes)]

    def is_finite(self) -> bool:
        return self.finite


class DiLoCo:
    """`shards` (a sharded peer, swarm/train/sharding.py): `params` are this rank's rows of the model's parameters, and
    the global parameters and outer momentum are those rows too; `layout` holds the whole tensors' shapes."""

    def __init__(self, model: torch.nn.Module, cfg: OuterConfig, global_device: str = "cpu", mix_alpha: float = 0.0,
                 shards: Optional[Shards] = None):
        self.model, self.mix_alpha, self.shards = model, mix_alpha, shards  # mix_alpha: what a landing keeps
        if shards is None:
            self.params = [p for p in model.parameters() if p.requires_grad]
            self.layout: Layout = Layout(tuple(p.shape for p in self.params))
        else:
            self.params, self.layout = local_params(model), shards.layout
        self.global_params = [p.detach().to(global_device, torch.float32, copy=True) for p in self.params]
        self.outer_optimizer = torch.optim.SGD(
            self.global_params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0,
            foreach=False,
        )
        self.round = 0  # rounds closed so far
        self.outer_steps = 0  # outer steps committed so far, on any fragment (swarm/__init__.py)
        self.version = 0
        self._digest: Optional[str] = None  # of the global parameters and momentum (statehash); reset on a change

    def pseudo_gradient(self, residual: Optional[Sequence[torch.Tensor]] = None) -> PseudoGradient:
        return PseudoGradient(self.global_params, self.params, residual)

    def outer_grads(self) -> list[torch.Tensor]:
        """Fresh fp32 buffers shaped like the global parameters, for the averaged pseudo-gradient."""
        return [torch.empty_like(g) for g in self.global_params]

    @torch.no_grad()
    def outer_step(self, averaged: Sequence[torch.Tensor] | Buffers, keep_local: bool = False,
                   indices: Optional[Sequence[int]] = None, closes_round: bool = True) -> None:
        """Apply the outer optimizer with `averaged` as the gradient, then move the local model to global (unless
        `keep_local`: a delayed round moves the local model itself, see swarm/train/overlap.py), keeping `mix_alpha`
        of itself. `indices`: a fragment's tensors only (swarm/train/fragments.py; SGD skips tensors without a
        gradient, so each fragment's momentum moves with it alone); `closes_round`: count a round."""
        indices = range(len(self.global_params)) if indices is None else indices
        targets = [self.global_params[i] for i in indices]
        averaged = Buffers.of(averaged)
        if len(averaged.shapes) != len(targets):
            raise ValueError(f"averaged pseudo-gradient has {len(averaged.shapes)} tensors, expected {len(targets)}")
        for g, shape in zip(targets, averaged.shapes):
            if shape != g.shape:
                raise ValueError(f"averaged pseudo-gradient shape {tuple(shape)} != {tuple(g.shape)}")
        with self.changing():
            for j, delta in averaged.each():  # one tensor at a time: SGD steps only the one with a gradient
                g = targets[j]
                g.grad = delta.to(g.device, torch.float32)
                self.outer_optimizer.step()
                g.grad = None
            self.round += closes_round
            self.outer_steps += 1
        if self.shards is not None:  # a collective: every rank steps here, and the hash is ready for any reader
            self.global_sha256()
        if keep_local:
            return
        for i in indices:
            p, g = self.params[i], self.global_params[i].to(self.params[i].device, self.params[i].dtype)
            if self.mix_alpha:  # Streaming DiLoCo's merge: alpha * local + (1 - alpha) * new global
                p.mul_(self.mix_alpha).add_(g, alpha=1 - self.mix_alpha)
            else:
                p.copy_(g)

    @torch.no_grad()
    def own_outer_step(self, index: int, pseudo_grad: torch.Tensor) -> torch.Tensor:
        """Global tensor `index` after the next outer step if the group's average were this peer's own
        `pseudo_grad` (global - local; torch's SGD rule: buf = momentum * buf + d, step = d + momentum * buf with
        Nesterov); nothing is changed."""
        g = self.global_params[index]
        hyper = self.outer_optimizer.param_groups[0]
        lr, m = hyper["lr"], hyper["momentum"]
        # The rule's operations in the order written above, but in two tensors rather than a fresh one per
        # operation: this runs at each delayed launch and land, over the whole model
        d = pseudo_grad.to(g.device, torch.float32, copy=True)
        if not m:
            return torch.sub(g, d.mul_(lr))
        buf = self.outer_optimizer.state.get(g, {}).get("momentum_buffer")
        step = d.clone() if buf is None else torch.mul(buf, m).add_(d)  # buf' = momentum * buf + d
        if hyper["nesterov"]:
            step.mul_(m).add_(d)  # d + momentum * buf'
        return torch.sub(g, step.mul_(lr), out=d)

    def changing(self):
        """Context for any change to the global parameters or the outer momentum (see `version`)."""
        return _Changing(self)

    def momentum_buffers(self) -> Optional[list[torch.Tensor]]:
        """The outer momentum, one buffer per global parameter; None before the first outer step."""
        state = self.outer_optimizer.state
        buffers = [state.get(g, {}).get("momentum_buffer") for g in self.global_params]
        if all(b is None for b in buffers):
            return None
        if any(b is None for b in buffers):  # a fragment that has not stepped yet (swarm/train/fragments.py): a zero
            buffers = [torch.zeros_like(g) if b is None else b for b, g in zip(buffers, self.global_params)]
            self.set_momentum(buffers)  # buffer steps exactly as none does (buf = momentum * 0 + d)
        return buffers

    def set_momentum(self, buffers: Optional[list[torch.Tensor]]) -> None:
        """Install (or, with None, drop) the outer momentum buffers."""
        for i, g in enumerate(self.global_params):
            if buffers is None:
                self.outer_optimizer.state.pop(g, None)
            else:
                self.outer_optimizer.state[g] = {"momentum_buffer": buffers[i]}

    @torch.no_grad()
    def sync_local(self) -> None:
        """local <- global (cast to the model's dtype and device)."""
        for p, g in zip(self.params, self.global_params):
            p.copy_(g.to(p.device, p.dtype))

    def hashed_tensors(self) -> list[torch.Tensor]:
        """The tensors the state's hash covers, in its order: the global parameters, then the outer momentum (if
        any) (swarm/state/statehash.py)."""
        return [*self.global_params, *(self.momentum_buffers() or [])]

    def global_sha256(self) -> str:
        """The state's hash (swarm/state/statehash.py): of the global parameters, the outer momentum and the count of
        rounds closed; equal on every peer that committed the same outer steps. A sharded peer's ranks digest the
        tensors together (`Shards.sha256`), where it is not known yet at the same point."""
        if self._digest is None and self.shards is not None:
            self._digest = self.shards.sha256(self.hashed_tensors())
        if self._digest is None:
            self._digest = tensors_digest(self.hashed_tensors())
        return state_sha256(self._digest, self.round)

    def known_sha256(self) -> Optional[str]:
        """`global_sha256()` where no collective is needed (always on an unsharded peer); else None: for paths
        that only some ranks take (a peer that failed)."""
        if self.shards is None or self._digest is not None:
            return self.global_sha256()
        return None


class _Changing:
    def __init__(self, diloco: DiLoCo):
        self.diloco = diloco

    def __enter__(self):
        self.diloco.version += 1
        self.diloco._digest = None

    def __exit__(self, *exc):
        self.diloco.version += 1
        self.diloco._digest = None
