"""A sharded peer's checkpoints (swarm/train/sharding.py): every rank writes its own rows of every tensor, in the one
checkpoint format of swarm/state/checkpoint.py, and reads its own rows back, whatever K wrote it.

    round-000012/
        index.json                               every tensor: dtype, whole shape, and its pieces
        inner-00001-of-00002.safetensors         rank 0's rows of the AdamW moments (and the step counts)
        global-00001-of-00002.safetensors        rank 0's rows of global.<param> and momentum.<param>, and the
                                                 peer's own error_feedback.<param> and rng, whole
        inner-00002-of-00002.safetensors, global-00002-of-00002.safetensors: rank 1's rows

Each rank writes its files into one shared `.partial-<token>-<n>` folder (the token is rank 0's pid, the same on
every rank; n counts the checkpoints begun, the same on every rank), then lists its pieces in
`pieces-<rank>.json` there. Rank 0 waits for every rank's list (at most `COLLECT_TIMEOUT_S`), writes the index
from them and renames the folder into place: a checkpoint is complete only once every shard of it is. A
reader (`Checkpointer.load` with blocks at offsets) takes the rows it holds from whichever pieces overlap
them, so a peer of K ranks resumes from a checkpoint of K' ranks, or of an unsharded peer, and `swarm export`
reads this one as any other.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from swarm.state import checkpoint_format as fmt
from swarm.state import tensorfile
from swarm.state.checkpoint import GLOBAL, INNER, Checkpointer

COLLECT_TIMEOUT_S = 600.0  # rank 0 waits this long for the other ranks' pieces of a checkpoint
Placement = Callable[[str], Optional[tuple[tuple[int, ...], tuple[int, ...]]]]
"""A tensor's (offset, whole shape) for a rank's rows of it; None for a tensor written whole (by rank 0 only)."""


class ShardCheckpointer(Checkpointer):
    """One rank's side of a sharded peer's checkpoints (module docstring)."""

    def __init__(self, directory: str | Path, keep: int, rank: int, world_size: int, token: int,
                 placement: Placement, **kwargs: Any):
        super().__init__(directory, keep, **kwargs)
        self.rank, self.world_size, self.token, self.placement = rank, world_size, token, placement
        self._count = 0
        self._pending = False  # a checkpoint begun and neither committed nor aborted: this rank may drop it

    def _file(self, name: str) -> str:
        return f"{name.removesuffix('.safetensors')}-{self.rank + 1:05d}-of-{self.world_size:05d}.safetensors"

    def _write_file(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        tensors = {k: t for k, t in tensors.items() if t.numel() or self.placement(k) is None}  # no empty rows
        if not tensors:
            return
        file = self._file(name)
        with open(self._partial / file, "wb") as f:
            crcs = tensorfile.write(f, tensors, {"format": "pt", "writer": fmt.FORMAT})
            f.flush()
            os.fsync(f.fileno())
        for key, t in tensors.items():
            where = self.placement(key)
            if where is None:
                self._entries[key] = fmt.tensor_entry(t, file, crcs[key])
                continue
            offset, shape = where
            self._entries[key] = {"dtype": tensorfile.dtype_name(t), "shape": list(shape), "pieces": [
                {"file": file, "offset": list(offset), "shape": list(t.shape), "crc32": crcs[key]}]}

    def begin(self, tensors: dict[str, torch.Tensor]) -> None:
        self.wait()
        self._count += 1
        self._partial = self.dir / f".partial-{self.token}-{self._count}"
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:  # folders of an earlier run of this peer (another token) that died mid-write
            for stale in self.dir.glob(".partial-*"):
                if not stale.name.startswith(f".partial-{self.token}-"):
                    shutil.rmtree(stale, ignore_errors=True)
        self._partial.mkdir(exist_ok=True)
        self._entries, self._pending = {}, True
        self._begun = self._run(lambda: self._write_file(INNER, tensors))

    def commit(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        begun, meta = self._begun, json.loads(json.dumps(meta))

        def finish() -> None:
            if begun is not None:
                begun.join()
            if self._error is not None:
                return
            self._write_file(GLOBAL, tensors)
            listing = self._partial / f"pieces-{self.rank}.json"
            with open(listing.with_suffix(".tmp"), "w") as f:
                json.dump(self._entries, f)
                f.flush()
                os.fsync(f.fileno())
            listing.with_suffix(".tmp").rename(listing)
            if self.rank != 0:
                return
            try:
                fmt.write_index(self._partial, meta, self._collect())
                self._install(self.dir / f"round-{int(meta['round']):06d}")
                self._prune()
            finally:
                self._close()
        self._pending = False
        self._committing = self._run(finish)  # `_begun` stays: until it ends, its tensors must not change

    def abort(self) -> None:
        """Drop a begun checkpoint (every rank drops it); never one committed, which rank 0 may be installing."""
        self.wait_begun()
        if self._pending:
            self._close()
            self._pending = False

    def _collect(self) -> dict[str, dict[str, Any]]:
        """Rank 0: every rank's pieces, merged by tensor (pieces in rank order)."""
        deadline = time.monotonic() + COLLECT_TIMEOUT_S
        lists = [self._partial / f"pieces-{r}.json" for r in range(self.world_size)]
        while not all(p.exists() for p in lists):
            if time.monotonic() > deadline:
                missing = [r for r, p in enumerate(lists) if not p.exists()]
                raise TimeoutError(f"ranks {missing} wrote no pieces of this checkpoint in {COLLECT_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        merged: dict[str, dict[str, Any]] = {}
        for p in lists:
            for name, entry in json.loads(p.read_text()).items():
                if name in merged:
                    merged[name]["pieces"] += entry["pieces"]
                else:
                    merged[name] = entry
        for p in lists:
            p.unlink()
        return merged
