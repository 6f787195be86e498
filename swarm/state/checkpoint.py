"""Checkpoints at round boundaries: safetensors files of tensors named by their state_dict names, an index,
atomic, checksummed; the last `checkpoint.keep` are kept.

A peer's checkpoint folder (`<peer folder>/checkpoint`, or `checkpoint.dir`):

    round-000012/            one complete checkpoint, renamed into place whole and never changed after
        index.json           the format, the meta and every tensor: dtype, shape and pieces
        inner.safetensors    the AdamW moments: `adam.<param>.exp_avg`, ...
        global.safetensors   `global.<param>` (the committed global parameters), `momentum.<param>` (outer
                             momentum), this peer's `error_feedback.<param>` and `rng`
    round-000011/            older ones, while `checkpoint.keep` allows
    .partial-<pid>/          one being written (removed by the next writer if its process died)

`<param>` is a parameter's name in the model's state_dict (swarm/state/peerstate.py `StateNames`). index.json is
`{"format": "swarm-checkpoint", "version": 1, "meta": {...}, "tensors": {name: {"dtype", "shape", "pieces":
[{"file", "offset", "shape", "crc32"}]}}, "sha256": ...}`, the hash taken over the rest of the index. The meta
holds the round, the inner step, outer steps, the run's fingerprint, its config and the model's Hugging Face
config (what `swarm export` builds the model from), the data position (shard, epoch, step) and the history.

The format, decided once with sharded peers in mind (issue 24): every file is plain safetensors
(`safetensors.torch.load_file` reads it), and a tensor is a list of *pieces*, each a block of the full tensor
at an `offset`, in a file the index names. An unsharded peer writes one piece per tensor, the whole of it; a
peer whose ranks each hold a shard writes one pair of files per rank (`global-00002-of-00004.safetensors`),
each rank its own pieces, and the index lists them all. A reader asks for blocks (`load`: a tensor and its
offset in the full tensor) and gets the parts of the pieces that overlap them, so a peer of K ranks reads a
checkpoint of K' ranks without gathering. We did not take torch.distributed.checkpoint: its files are pickles
that only its planner reads, with a process group, even to export; per-rank files and resharding by offsets
are what we need of it, and the index gives them over plain safetensors.

Writing streams each live tensor's bytes (no serialized copy of the state in memory), in two parts on background
threads so that a round's checkpoint costs it almost nothing (`Checkpointer`). Reading checks the index (its
hash; every piece against its file's header and size) and the crc32 of every piece it will read BEFORE anything
is loaded, then reads each piece straight into the caller's tensors; a damaged checkpoint raises
`CorruptCheckpoint` naming it and leaves them untouched.

Cost at 85M parameters (1.36 GB of global parameters, momentum and moments): the moments are written while the
round averages, the rest and the fsync while the next round's inner steps run; the round waits only if those
take longer (bench/scale.py reports what is left as `overhead_s`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch

from swarm.errors import SwarmError
from swarm.state import checkpoint_format as fmt
from swarm.state import tensorfile
from swarm.state.checkpoint_format import INDEX, CorruptCheckpoint
from swarm.state.peerstate import TensorSpec
from swarm.tensors import dtype_of

INNER, GLOBAL = "inner.safetensors", "global.safetensors"
ROUND = re.compile(r"round-(\d+)")
OPEN_TRIES = 3  # a reader racing the writer's pruning opens the newer checkpoint instead
Target = Union[torch.Tensor, tuple[torch.Tensor, tuple[int, ...]]]
"""Where `load` puts a tensor: the whole of it, or (block, offset of the block in the full tensor)."""


class Checkpointer:
    """Writes and reads one peer's checkpoints, in two parts written by background threads, so that a round's
    checkpoint costs the round almost nothing:

    - `begin(tensors)` once a round's inner steps are done, with the tensors the next inner step changes
      (the AdamW moments): they stay put while the round averages. Call `wait_begun()` before changing them.
    - `commit(tensors, meta)` once the round committed, with the rest (global parameters and outer momentum,
      which change only at the next outer step): then the index, fsync, the rename into place and the pruning
      of checkpoints beyond `keep`. Call `wait()` before changing them, and before the process exits. `abort()`
      drops a begun checkpoint whose round was discarded. `save(tensors, meta)` writes a whole checkpoint now.

    `pinned` reads that one checkpoint (a round folder) instead of the latest.
    """

    def __init__(self, directory: str | Path, keep: int = 1, pinned: Optional[Path] = None):
        self.dir, self.keep, self.pinned = Path(directory), max(1, keep), pinned
        self._partial = self.dir / f".partial-{os.getpid()}"
        self._entries: dict[str, dict[str, Any]] = {}
        self._begun: Optional[threading.Thread] = None
        self._committing: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.last_read: Optional[Path] = None  # the checkpoint the last `load` read

    # ---- writing -------------------------------------------------------------------------------------
    def _run(self, work: Callable[[], None]) -> threading.Thread:
        def guarded() -> None:
            try:
                work()
            except BaseException as e:  # surfaced by wait(); the last good checkpoint stays in place
                self._error = self._error or e
        thread = threading.Thread(target=guarded, name="checkpoint", daemon=False)
        thread.start()
        return thread

    def _write_file(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:
            return
        with open(self._partial / name, "wb") as f:
            crcs = tensorfile.write(f, tensors, {"format": "pt", "writer": fmt.FORMAT})
            f.flush()
            os.fsync(f.fileno())
        self._entries.update({key: fmt.tensor_entry(t, name, crcs[key]) for key, t in tensors.items()})

    def begin(self, tensors: dict[str, torch.Tensor]) -> None:
        """Start a checkpoint: write `tensors` (they must not change until `wait_begun()`) in the background."""
        self.wait()
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".partial-*"):  # left by a process that died mid-write
            shutil.rmtree(stale, ignore_errors=True)
        self._partial.mkdir()
        self._entries = {}
        self._begun = self._run(lambda: self._write_file(INNER, tensors))

    def wait_begun(self) -> float:
        """Until the begun tensors are on disk (a commit since changes nothing: they are still being read); the
        seconds waited."""
        start = time.perf_counter()
        if self._begun is not None:
            self._begun.join()
            self._begun = None
        return time.perf_counter() - start

    def commit(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Finish the begun checkpoint with `tensors` (they must not change until `wait()`) and `meta` (its
        `round` names the checkpoint), as `meta` is now: the caller may go on changing what it holds."""
        begun, meta = self._begun, json.loads(json.dumps(meta))

        def finish() -> None:
            if begun is not None:
                begun.join()
            try:
                if self._error is not None:
                    return
                self._write_file(GLOBAL, tensors)
                fmt.write_index(self._partial, meta, self._entries)
                self._install(self.dir / f"round-{int(meta['round']):06d}")
                self._prune()
            finally:
                self._close()
        self._committing = self._run(finish)  # `_begun` stays: until it ends, its tensors must not change

    def _install(self, target: Path) -> None:
        """Rename the written checkpoint into place (replacing one of the same round), durably."""
        aside = self.dir / f".replaced-{os.getpid()}"
        if target.exists():
            target.rename(aside)
        self._partial.rename(target)
        shutil.rmtree(aside, ignore_errors=True)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _prune(self) -> None:
        """Delete the checkpoints beyond the newest `keep`."""
        for old in self.rounds()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Drop the begun checkpoint (its round was discarded); the last good one stays."""
        self.wait_begun()
        self._close()

    def _close(self) -> None:
        shutil.rmtree(self._partial, ignore_errors=True)

    def close(self) -> None:
        """When training stops, normally or not: finish a committed checkpoint, drop one never committed."""
        if self._committing is None:
            self.abort()
        self.wait()

    def save(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Write a whole checkpoint now (not in the background)."""
        self.begin({})
        self.commit(tensors, meta)
        self.wait()

    def wait(self) -> None:
        """Until the last checkpoint is complete on disk (or dropped); re-raises what went wrong writing it."""
        self.wait_begun()
        if self._committing is not None:
            self._committing.join()
            self._committing = None
        if self._error is not None:
            error, self._error = self._error, None
            self._close()
            raise SwarmError(f"cannot write checkpoint in {self.dir}: {error}") from error

    # ---- reading -------------------------------------------------------------------------------------
    def rounds(self) -> list[Path]:
        """The complete checkpoints of the current format, oldest first."""
        found = [p for p in self.dir.glob("round-*") if ROUND.fullmatch(p.name) and (p / INDEX).is_file()]
        return sorted(found, key=lambda p: int(ROUND.fullmatch(p.name)[1]))

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint (a round folder); None if none."""
        if self.pinned is not None:
            return self.pinned
        rounds = self.rounds()
        return rounds[-1] if rounds else None

    def exists(self) -> bool:
        self.wait()
        return self.latest() is not None

    def _open(self) -> fmt.Opened:
        self.wait()
        for attempt in range(OPEN_TRIES):
            path = self.latest()
            if path is None:
                raise CorruptCheckpoint(f"no checkpoint in {self.dir}")
            try:
                return fmt.open_folder(path)
            except CorruptCheckpoint:
                if path.exists() or self.pinned is not None or attempt == OPEN_TRIES - 1:
                    raise  # not pruned away under us: damaged
        raise AssertionError("unreachable")

    def read_meta(self) -> dict[str, Any]:
        """The meta of the latest checkpoint, after checking its index (not its tensors: `load` does)."""
        with self._open() as opened:
            return opened.meta

    def load(self, destinations: Callable[[list[TensorSpec]], dict[str, Target]]) -> dict[str, Any]:
        """Check the latest checkpoint, then read its tensors into `destinations(specs)` (by name: a tensor, or a
        block and its offset; names left out are not read); return the meta. `destinations` raises ValueError
        for a state that does not fit this peer (a CorruptCheckpoint here). Every checksum is checked before
        any destination is written."""
        with self._open() as opened:
            targets = _fitting(opened, destinations)
            plan = []
            for name, target in targets.items():
                block, at = target if isinstance(target, tuple) else (target, (0,) * target.dim())
                plan += [(name, piece, block, at) for piece in opened.tensors[name][1]
                         if fmt.overlap(piece, block, at) is not None]
            _read(opened, plan)
            self.last_read = opened.path
            return opened.meta

    def each(self, wanted: Callable[[list[TensorSpec]], list[str]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of the latest checkpoint that `wanted(specs)` names, in its order, one at a time: each a
        fresh CPU tensor, gathered from its pieces (whatever ranks wrote them) and checked by its checksums before
        it is yielded, so a reader holds one tensor of the checkpoint at a time. The checkpoint stays open until
        the iterator ends: every tensor comes from the checkpoint it began with, even if the peer prunes it."""
        with self._open() as opened:
            names = _fitting(opened, wanted)
            self.last_read = opened.path
            for name in names:
                spec, pieces = opened.tensors[name]
                whole = torch.empty(spec.shape, dtype=dtype_of(spec.dtype))
                _read(opened, [(name, piece, whole, (0,) * whole.dim()) for piece in pieces])
                yield name, whole
                del whole  # before the next one is read

    def load_all(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Every tensor as a fresh CPU tensor, and the meta (for tests and tools)."""
        tensors: dict[str, torch.Tensor] = {}

        def fresh(specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
            tensors.update({s.name: torch.empty(s.shape, dtype=dtype_of(s.dtype)) for s in specs})
            return tensors
        meta = self.load(fresh)
        return tensors, meta


def _fitting(opened: fmt.Opened, choose: Callable[[list[TensorSpec]], Any]) -> Any:
    """`choose(specs)`, its ValueError (a state that does not fit the reader) a CorruptCheckpoint naming it."""
    try:
        return choose([spec for spec, _ in opened.tensors.values()])
    except ValueError as e:
        raise CorruptCheckpoint(f"checkpoint {opened.path} does not fit this model: {e}") from None


def _read(opened: fmt.Opened, plan: list[tuple[str, fmt.Piece, torch.Tensor, tuple[int, ...]]]) -> None:
    """Check the checksum of every (name, piece, block, offset) of `plan`, then read each piece into its block."""
    try:
        for name, piece, *_ in plan:
            if tensorfile.crc32(piece.file, piece.start, piece.nbytes) != piece.crc32:
                raise CorruptCheckpoint(f"corrupt checkpoint {opened.path}: {name} fails its checksum")
        for name, piece, block, at in plan:
            fmt.place(piece, opened.tensors[name][0], block, at)
    except OSError as e:
        raise CorruptCheckpoint(f"corrupt checkpoint {opened.path}: {type(e).__name__}: {e}") from None
