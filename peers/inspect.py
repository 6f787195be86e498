"""`swarm config show` and `--dry-run`: what a peer would run, checked, without training.

`show_config` prints the resolved config (file, then overrides, `diloco.delay: auto` resolved) as YAML with the
per-peer keys marked, the hash of the run config, and the run's fingerprint (swarm/run/runid.py) when the corpus
is prepared. `dry_run` checks everything a peer needs before it trains (its run folder is writable, the
metrics sinks it asks for are installed, the corpus prepares and opens, its identity file loads or can be
created, its addresses parse) and prints what it found; for `swarm join`, also whether the run would let
it in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch
import yaml

from swarm.config import CORPUS_LOCATION_KEYS, Config, is_per_peer, per_peer_keys
from swarm.errors import SwarmError, UsageError
from swarm.run.runid import RunIdentity, run_identity, weights_sha256


def _value(value) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
    return text[:-4].strip() if text.endswith("\n...") else text


def show_config(cfg: Config, path: Optional[str], overrides: list[str]) -> str:
    """The text of `swarm config show`."""
    lines = [f"# {path or 'defaults'}{f' with overrides {json.dumps(overrides)}' if overrides else ''}"]
    for section, values in cfg.to_dict().items():
        whole = is_per_peer(section)
        lines.append(f"{section}:{'  # per peer' if whole else ''}")
        for key, value in values.items():
            mark = ("  # per peer" if is_per_peer(f"{section}.{key}") and not whole else
                    "  # where this copy lies" if f"{section}.{key}" in CORPUS_LOCATION_KEYS else "")
            lines.append(f"  {key}: {_value(value)}{mark}")
    shared = run_identity_if_prepared(cfg)
    lines.append(f"# per peer (each peer's own, not part of the run): {', '.join(per_peer_keys())}")
    if shared is None:
        lines.append("# fingerprint: needs the prepared corpus (`swarm data prepare` with this config; a peer "
                     "prepares it at start)")
    else:
        lines.append(f"# fingerprint: {shared.fingerprint} (the run config above without the per-peer keys and "
                     f"where the corpus lies, "
                     f"corpus sha256 {shared.corpus_sha256[:16]}, initial weights "
                     f"{shared.weights_sha256[:16] if shared.weights_sha256 else 'a seeded random init'})")
    return "\n".join(lines)


def run_identity_if_prepared(cfg: Config) -> Optional[RunIdentity]:
    """The run's identity if its corpus is on disk already (nothing is tokenized to show a config)."""
    from swarm.config import shared_config
    from swarm.data.tokens import corpus_folder

    meta = corpus_folder(cfg.data) / "meta.json"
    if not meta.exists():
        return None
    return RunIdentity(shared_config(cfg), json.loads(meta.read_text())["sha256"],
                       weights_sha256(cfg.model.pretrained))


def _writable(folder: Path, option: str) -> None:
    """UsageError naming `option` unless `folder` exists writable or can be created."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
        raise UsageError(f"{option} {folder}: cannot write there ({existing} is not a writable folder)")


def dry_run(cfg: Config, out: Path, networked: bool, run: Optional[RunIdentity] = None, nproc: int = 1,
            local_peers: Optional[int] = None) -> int:
    """Check and print what a peer of `cfg` (of `nproc` ranks) would start with, its memory per rank among it;
    exit 0 without training. `run`: the identity of the run it joins (`swarm join`), which its own must match.
    `local_peers`: `out` is the folder of a `swarm local` of that many peers, each in its own `peer-<i>/`.
    The memory plan is printed first, on any machine: a machine that cannot hold it then exits 2 naming why."""
    from peers.prepare import check_prepared
    from swarm.data.batches import load_corpus
    from swarm.run.metrics import check_available
    from swarm.train.ranks import check_batch, check_rows

    check_batch(cfg, nproc)
    check_rows(cfg, nproc)
    _writable(out, "--out")
    check_available(cfg)
    if cfg.model.vocab_size is not None:  # the plan first, on any machine and before the data is there
        memory_plan(cfg, nproc, cfg.model.vocab_size)
    check_prepared(cfg.data)
    corpus = load_corpus(cfg.data)
    if cfg.model.vocab_size is None:
        memory_plan(cfg, nproc, corpus.tokenizer.vocab_size)
    meta = corpus.prepared.meta
    print(f"config: ok (run {cfg.swarm.run_id!r}, {cfg.diloco.rounds} rounds x {cfg.diloco.inner_steps} inner "
          f"steps, delay {cfg.diloco.delay}, {cfg.diloco.fragments} fragment(s))")
    print(f"corpus: {corpus.prepared.folder} ({meta['train_tokens']} train and {meta['eval_tokens']} eval tokens, "
          f"sha256 {meta['sha256'][:16]})")
    files = "log.txt, metrics.csv, checkpoint/" + (", identity.key, ledger.json" if networked or local_peers else "")
    if local_peers is None:
        print(f"run folder: {out} ({files})")
    else:
        last = f" .. {out / f'peer-{local_peers - 1}'}" if local_peers > 1 else ""
        print(f"run folder: {out} (log.txt, bootstrap.log and bootstrap/, summary.json, loss.png); each peer's in "
              f"{out / 'peer-0'}{last} ({files})")
    mine = run_identity(cfg, meta["sha256"])
    if networked:
        _network(cfg, out)
    if run is not None and (difference := mine.first_difference(run)):
        raise SwarmError(f"run {cfg.swarm.run_id!r} would refuse this peer: {difference}")
    print(f"fingerprint: {mine.fingerprint}" + (" (the run's)" if run is not None else ""))
    print("dry run: everything checked, nothing trained")
    return 0


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def memory_plan(cfg: Config, nproc: int, vocab_size: int) -> None:
    """Print what each rank would hold (swarm/train/accounting.py), then UsageError if this machine cannot: too few
    devices, a device too small, or too little memory for the node's ranks, naming the biggest item."""
    from swarm.train import accounting
    from swarm.train.ranks import check_devices

    shapes = accounting.shapes_of(cfg, vocab_size)
    items = accounting.plan(cfg, shapes, nproc, vocab_size)
    total = accounting.memory(cfg, shapes, nproc, vocab_size)
    params = f"{shapes.params / 1e9:.1f}B" if shapes.params >= 1e9 else f"{shapes.params / 1e6:.1f}M"
    print(f"memory per rank ({nproc} rank(s), inner.parallel {cfg.inner.parallel}, {params} parameters; "
          f"swarm/train/accounting.py, an estimate):")
    for item in items:
        print(f"  {item.where:<10} {_size(item.bytes):>11}  {item.what}")
    print(f"  = {_size(total['device_per_rank'])} on each device ({cfg.diloco.device}), "
          f"{_size(total['host_per_node'])} of host memory and {_size(total['page_cache'])} of page cache per node")

    def biggest(places: tuple[str, ...]) -> str:
        item = max((i for i in items if i.where in places), key=lambda i: i.bytes)
        return f"its biggest item: {item.what} ({_size(item.bytes)} per rank)"

    check_devices(cfg, nproc)
    on_cuda = torch.device(cfg.diloco.device).type == "cuda"
    for index in range(nproc if on_cuda else 0):
        if (have := torch.cuda.get_device_properties(index).total_memory) < total["device_per_rank"]:
            raise UsageError(f"cuda:{index} holds {_size(have)}, the plan above {_size(total['device_per_rank'])} "
                             f"per rank; {biggest(('device',))}")
    on_host = ("host",) if on_cuda else ("host", "device")
    need = nproc * sum(i.bytes for i in items if i.where in on_host)
    if need > (ram := os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")):
        raise UsageError(f"this machine has {_size(ram)} of memory, the plan above {_size(need)} for {nproc} "
                         f"rank(s); {biggest(on_host)}")


def _network(cfg: Config, out: Path) -> None:
    from swarm.net.addresses import unreachable_warning
    from swarm.net.dht import check_addresses
    from swarm.net.identity import load_identity

    s = cfg.swarm
    check_addresses(s)
    key = Path(s.identity) if s.identity is not None else out / "identity.key"  # as peers/node.py takes it
    if key.exists():
        print(f"identity: {key} (peer id {load_identity(str(key)).peer_id})")
    else:
        _writable(key.parent, "swarm.identity")
        print(f"identity: {key} (created at start)")
    print(f"listens on: {' '.join(s.host_maddrs)}" + (f", announces {' '.join(s.announce_maddrs)}"
                                                       if s.announce_maddrs else ""))
    announced = s.announce_maddrs or [m for m in s.host_maddrs if "/0.0.0.0/" not in m]
    if announced and (warning := unreachable_warning(announced, s.client_mode)):
        print(f"warning: {warning}")
    print(f"initial peers: {' '.join(s.initial_peers) or 'none: it starts a new swarm'}")
