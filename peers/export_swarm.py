"""`swarm export --from-swarm RUN --initial-peers ... --hf-out DIR`: the swarm's current committed model, with no
peer of one's own.

It takes the state as a joiner does and takes part in nothing else: the run's config from its manifest
(peers/join.py, with this command's per-peer overrides, e.g. `--model.pretrained DIR` for a warm-started run),
a client-mode `SwarmAverager` (it serves nothing and owns no part of any all-reduce) and one
`SwarmAverager.fetch_state` from outer step 0, which downloads the state of the donors the swarm's records
name and checks it against what the swarm committed, as it does for every joiner. Only the global parameters
are kept, written straight into the model's parameters; the rest of the state (outer momentum, AdamW moments)
passes through one buffer the size of the tensor being received, and is dropped. Then `write_hf`
(swarm/state/export.py). The exporter's progress record (round 0, not ready) stays in the DHT until it expires
(`swarm.progress_expiration`).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from pathlib import Path
from typing import Any, Optional

import torch

from swarm.errors import SwarmError, UsageError
from swarm.state.peerstate import TensorSpec
from swarm.tensors import dtype_of
from swarm.train.averaging import Intake

log = logging.getLogger("swarm.export")


class _Targets(dict):
    """A downloaded state's destinations: the global parameters are the model's; any other tensor, asked for by
    name, gets one buffer of its own shape (the previous one is dropped: a state arrives tensor by tensor)."""

    def __init__(self, params: list[torch.Tensor], specs: list[TensorSpec]):
        super().__init__({f"global.{i}": p.data for i, p in enumerate(params)})
        self.specs, self.last = {s.name: s for s in specs}, None

    def __missing__(self, name: str) -> torch.Tensor:
        if self.last is None or self.last[0] != name:
            spec = self.specs[name]
            self.last = (name, torch.empty(spec.shape, dtype=dtype_of(spec.dtype)))
        return self.last[1]


def intake(model: torch.nn.Module, taken: dict[str, Any]) -> Intake:
    """How the exporter takes a state in: `taken` receives its round (outer steps) and meta."""
    params = [p for p in model.parameters() if p.requires_grad]

    def destinations(specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
        found = {s.name: s for s in specs if s.name.startswith("global.")}
        for i, p in enumerate(params):
            spec = found.get(f"global.{i}")
            if spec is None or (spec.dtype, tuple(spec.shape)) != ("float32", tuple(p.shape)):
                raise ValueError(f"global.{i} is {spec and [spec.dtype, list(spec.shape)]}, the model's parameter "
                                 f"float32 {list(p.shape)}")
        if len(found) != len(params):
            raise ValueError(f"it holds {len(found)} global parameters, the model {len(params)}")
        return _Targets(params, specs)

    def accept(meta: dict[str, Any], outer_steps: int) -> None:
        taken.update(meta=meta, outer_steps=outer_steps)
    return Intake(destinations, accept)


def export_from_swarm(run_id: str, initial_peers: list[str], overrides: list[str], out: Path, dtype: str = "fp32",
                      force: bool = False) -> tuple[Path, Optional[int]]:
    """Write the Hugging Face folder `out` from the state run `run_id` committed last; (out, its round)."""
    from peers.join import joined_config
    from swarm.data.batches import build_tokenizer
    from swarm.net.dht import start_dht
    from swarm.net.identity import load_identity, with_work
    from swarm.net.peer import SwarmAverager
    from swarm.state.export import check_target, write_hf
    from swarm.state.pretrained import check
    from swarm.train.model import build_model

    check_target(out, dtype, force)
    cfg, run = joined_config(run_id, initial_peers, overrides)
    check(cfg)
    if run.weights_sha256 is not None and cfg.model.pretrained is None:
        raise UsageError(f"run {run_id!r} starts from pretrained weights (sha256 {run.weights_sha256[:16]}): pass "
                         f"--model.pretrained DIR, a copy of them, for its model's architecture")
    tokenizer = build_tokenizer(cfg.data)
    model = build_model(cfg.model, tokenizer.vocab_size, cfg.data.tokenizer)
    client = dataclasses.replace(cfg.swarm, client_mode=True, identity=None)
    fingerprint, identity, taken = run.fingerprint, with_work(load_identity(None), client.identity_work), {}
    dht = start_dht(client, identity, fingerprint=fingerprint)
    try:
        averager = SwarmAverager(client, dht, identity, fingerprint, f"export-{socket.gethostname()}")
        try:
            got = averager.fetch_state(intake(model, taken), 0, "")
        finally:
            averager.close()
    finally:
        dht.shutdown()
    if got is None:
        raise SwarmError(f"run {run_id!r} has committed no round yet: there is no model to export")
    round = taken["meta"].get("round")
    log.info("took the state of round %s (%d outer steps) from %s: %.0f MB in %.1f s", round, got.outer_step, got.donor,
             got.bytes / 1e6, got.seconds)
    return write_hf(model, tokenizer, out, dtype, force), round
