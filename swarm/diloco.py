"""The DiLoCo outer step, attached at the optimizer boundary (like torchft's `DiLoCo` wrapper).

`DiLoCo` keeps the global parameters (fp32, on `global_device`) and the outer optimizer, SGD with
Nesterov momentum. One round, seen from a peer:

    pseudo_grad = diloco.pseudo_gradient()        # global - local, after H inner steps
    averaged    = averager.average(pseudo_grad)   # weighted mean over the group
    diloco.outer_step(averaged)                   # global <- outer SGD step; local <- global

Sign convention: the pseudo-gradient is `global - local`, so it points where a gradient points (the
local model moved *against* it). With outer lr 1 and no momentum the outer step lands exactly on the
(averaged) local parameters: that is FedAvg, and a test pins it.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch

from swarm.config import OuterConfig


class DiLoCo:
    def __init__(self, model: torch.nn.Module, cfg: OuterConfig, global_device: str = "cpu"):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.global_params = [p.detach().to(global_device, torch.float32, copy=True) for p in self.params]
        self.outer_optimizer = torch.optim.SGD(
            self.global_params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0
        )
        self.round = 0  # outer steps committed so far
        self._sha256: Optional[str] = None  # hash of global_params; reset whenever they change

    @torch.no_grad()
    def pseudo_gradient(self) -> list[torch.Tensor]:
        """global - local, in fp32 on the global device."""
        return [g - p.detach().to(g.device, torch.float32) for g, p in zip(self.global_params, self.params)]

    @torch.no_grad()
    def outer_step(self, averaged: list[torch.Tensor]) -> None:
        """Apply the outer optimizer with `averaged` as the gradient, then reset the local model to global."""
        if len(averaged) != len(self.global_params):
            raise ValueError(f"averaged pseudo-gradient has {len(averaged)} tensors, "
                             f"expected {len(self.global_params)}")
        for g, delta in zip(self.global_params, averaged):
            if delta.shape != g.shape:
                raise ValueError(f"averaged pseudo-gradient shape {tuple(delta.shape)} != {tuple(g.shape)}")
            g.grad = delta.to(g.device, torch.float32)
        self.outer_optimizer.step()
        self._sha256 = None
        self.outer_optimizer.zero_grad(set_to_none=True)
        self.round += 1
        self.sync_local()

    @torch.no_grad()
    def sync_local(self) -> None:
        """local <- global (cast to the model's dtype and device)."""
        for p, g in zip(self.params, self.global_params):
            p.copy_(g.to(p.device, p.dtype))

    def global_sha256(self) -> str:
        """Hash of the global parameters' bytes: equal on every peer that committed the same rounds."""
        if self._sha256 is None:
            digest = hashlib.sha256()
            for g in self.global_params:
                digest.update(g.detach().cpu().contiguous().numpy().tobytes())
            self._sha256 = digest.hexdigest()
        return self._sha256

    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "global_params": [g.detach().cpu().clone() for g in self.global_params],
            "outer_optimizer": self.outer_optimizer.state_dict(),
        }

    def validate_state(self, state: dict[str, Any]) -> None:
        """Raise ValueError unless `state` fits this model (a donor's or a checkpoint's)."""
        params = state.get("global_params")
        if not isinstance(params, list) or len(params) != len(self.global_params):
            raise ValueError("state holds a different number of global parameters")
        for i, (t, g) in enumerate(zip(params, self.global_params)):
            if not isinstance(t, torch.Tensor) or t.shape != g.shape:
                shape = tuple(getattr(t, "shape", ()))
                raise ValueError(f"global parameter {i} has shape {shape}, expected {tuple(g.shape)}")
            if not torch.isfinite(t).all():
                raise ValueError(f"global parameter {i} holds NaN or Inf")

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.validate_state(state)
        for g, t in zip(self.global_params, state["global_params"]):
            g.copy_(t)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.round = int(state["round"])
        self._sha256 = None
        self.sync_local()
