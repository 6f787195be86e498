"""One run identity: what every peer of a run shares, and its fingerprint.

A run is its config without the per-peer keys (`config.shared_config`: model, data, inner and outer
optimizers, the DiLoCo schedule with its delay and fragments, the swarm's rules and timings) and without where
its corpus lies (`config.CORPUS_LOCATION_KEYS`: a dataset's path or hub name, its tokenizer's), the content of
its prepared corpus (the sha256 of its token files, swarm/data/tokens.py meta.json) and, for a run that starts
from `model.pretrained`, the content of those initial weights. The fingerprint hashes all three: two peers
average together only if they hold the same. Each peer signs the fingerprint it runs (`{run}_run`, swarm/net/
dht.py) and its copy of the run's manifest (swarm/net/manifest.py) carries the three parts, so that a peer
refused by a running swarm is told the first part that differs (`first_difference`), key by key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional

from swarm.config import CORPUS_LOCATION_KEYS, Config, shared_config
from swarm.state.pretrained import pretrained_sha256


@dataclass(frozen=True)
class RunIdentity:
    config: dict[str, dict]  # config.shared_config of the run's config
    corpus_sha256: str  # the prepared corpus's content hash; "" where unknown (a manifest of an older peer)
    weights_sha256: Optional[str] = None  # model.pretrained's weights' hash; None: a seeded random init

    @property
    def fingerprint(self) -> str:
        blob = json.dumps({"config": _without_location(self.config), "corpus": self.corpus_sha256,
                           "weights": self.weights_sha256}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def first_difference(self, run: RunIdentity) -> Optional[str]:
        """A line naming the first part of this identity that differs from `run`'s (config keys in order, less
        where the corpus lies: its content is compared instead), or None if both are the same."""
        mine, theirs = _leaves(_without_location(self.config)), _leaves(_without_location(run.config))
        for key in sorted(set(mine) | set(theirs)):
            here, there = mine.get(key, _MISSING), theirs.get(key, _MISSING)
            if here != there:
                return f"{key} is {_show(here)} here but {_show(there)} in the run"
        if self.corpus_sha256 != run.corpus_sha256:
            return (f"the prepared corpus differs (sha256 {self.corpus_sha256[:16] or '?'} here, "
                    f"{run.corpus_sha256[:16] or '?'} in the run: another dataset, tokenizer or version of it)")
        if self.weights_sha256 is None and run.weights_sha256 is not None:
            return (f"the run starts from pretrained weights (sha256 {run.weights_sha256[:16]}): pass "
                    f"--model.pretrained DIR, this peer's copy of them")
        if self.weights_sha256 != run.weights_sha256:
            return (f"model.pretrained's weights differ (sha256 {(self.weights_sha256 or 'none')[:16]} here, "
                    f"{(run.weights_sha256 or 'none')[:16]} in the run)")
        return None


_MISSING = object()


def _without_location(config: dict[str, dict]) -> dict[str, dict]:
    """`config` less config.CORPUS_LOCATION_KEYS: where a copy of the corpus lies is no part of the run."""
    return {section: {k: v for k, v in values.items() if f"{section}.{k}" not in CORPUS_LOCATION_KEYS}
            for section, values in config.items()}


def _show(value: Any) -> str:
    return "unset" if value is _MISSING else json.dumps(value)


def _leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def weights_sha256(pretrained: Optional[str]) -> Optional[str]:
    """The hash of the initial weights of `model.pretrained`, wherever the folder lies (swarm/state/pretrained.py
    `pretrained_sha256`: its config.json and weight files by content); None without one."""
    return None if pretrained is None else pretrained_sha256(pretrained)


def corpus_sha256(cfg: Config) -> str:
    """The content hash of the corpus of `cfg`, prepared first if it is not yet (swarm/data/batches.py)."""
    from swarm.data.batches import load_corpus

    return load_corpus(cfg.data).prepared.meta["sha256"]


def run_identity(cfg: Config, corpus: Optional[str] = None) -> RunIdentity:
    """The identity of the run `cfg` belongs to; `corpus`: its corpus hash if known (else it is read, the corpus
    prepared if need be)."""
    return RunIdentity(shared_config(cfg), corpus if corpus is not None else corpus_sha256(cfg),
                       weights_sha256(cfg.model.pretrained))
