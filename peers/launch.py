"""`--nproc-per-node K`: the K ranks of one peer, forked from the process that parsed the command.

`torchrun --standalone` would start K fresh interpreters, each importing torch, transformers and hivemind
again (~4 s of CPU each, all at once); a peer on one node needs none of its elastic machinery. `launch_ranks`
forks K ranks from this process instead, before any thread is started, and gives each the environment
torchrun's workers get (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`:
swarm/train/ranks.py joins the process group from them), so `torchrun --nproc-per-node K -m swarm.cli peer ...` still
works the same. CUDA is first touched inside the ranks, never here, so forking is safe on a GPU node.

As under torchrun: a rank that fails (non-zero exit, or killed) ends the peer: the others get SIGTERM, then
SIGKILL after `STOP_GRACE_S`, and the launcher exits 1. SIGTERM or SIGINT to the launcher reach every rank
(each shuts down cleanly, rank 0 writing its summary) and the launcher exits with rank 0's status. A rank
gets SIGTERM if the launcher dies (PR_SET_PDEATHSIG), also on kill -9.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from typing import Callable, NoReturn

from peers.forkserver import die_with

STOP_GRACE_S = 30.0  # ranks asked to stop get this long (a checkpoint to finish) before SIGKILL


def exit_rank(code: int) -> NoReturn:
    """End a rank's process with `code`, its output flushed, running no destructor. ProcessGroupGloo's destructor
    joins its worker threads holding the GIL, while a worker that releases the last C++ reference to a tensor a
    collective from Python gave it (the work, or the barrier after it that holds it) waits for the GIL to drop the
    tensor's Python object: a rank that had written everything hung for good (py-spy --native: the main thread in
    std::thread::join under ~ProcessGroupGloo, a worker in gil_scoped_acquire under ~AsyncWork; about 1 run in
    40 of a two-rank peer on a loaded machine). Nothing of the process group needs tearing down when its
    process ends, so none is: the ranks leave it to the kernel, as torchrun leaves a killed worker's."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on now (rank 0 binds it for the process group's store)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_ranks(nproc: int, run_rank: Callable[[], int]) -> int:
    """Fork `nproc` ranks that each return `run_rank()` as this call's result (the caller exits with it); in
    the launcher, supervise them and return the peer's exit status."""
    launcher, port = os.getpid(), free_port()
    ranks: dict[int, int] = {}  # pid -> rank
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            die_with(launcher)
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                              LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            return run_rank()
        ranks[pid] = rank
    return _supervise(ranks)


def _supervise(ranks: dict[int, int]) -> int:
    """Wait for every rank; the first failure stops the others. Returns 1 if a rank failed, else rank 0's
    status (0, or 128 + the signal that stopped the peer)."""
    alive, codes, stop_at = set(ranks), {}, None

    def forward(signum, _frame) -> None:
        nonlocal stop_at
        _signal(alive, signal.SIGTERM)
        stop_at = stop_at or time.monotonic() + STOP_GRACE_S
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        while alive:
            if stop_at is not None and time.monotonic() > stop_at:
                _signal(alive, signal.SIGKILL)
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(0.05)
                continue
            if pid not in alive:
                continue
            alive.discard(pid)
            codes[ranks[pid]] = code = os.waitstatus_to_exitcode(status)
            if code != 0 and stop_at is None:  # one rank failed: the peer is over
                _signal(alive, signal.SIGTERM)
                stop_at = time.monotonic() + STOP_GRACE_S
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return codes[0] if len(set(codes.values())) == 1 else 1


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
