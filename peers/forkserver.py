"""Child processes forked from one process that imported torch, transformers and hivemind once.

A `swarm peer` spends ~4 s of CPU importing torch, transformers, hivemind and the training code before it does
anything (`python -X importtime -m swarm.cli peer ...`); a launcher starting N peers on a small machine pays that N
times over, all at once. `ForkServer` starts one server process (`python -m peers.forkserver MODULE...`) that imports
those modules and then, single-threaded, forks a child per request: the child runs `python -m MODULE ARGV` (or a
script) as a fresh interpreter would, but with the imports done, in ~10 ms. hivemind itself forks its DHT process
from a peer that imported all of this, which is the same condition.

What a child gets, as `subprocess.Popen(..., start_new_session=True)` would give it: a session of its own (a
Ctrl-C at the launcher's terminal reaches only the launcher), the caller's environment and working directory,
stdin from /dev/null, stdout and stderr to files, `sys.argv`, and a normal interpreter exit (non-daemon threads
joined, atexit handlers run, streams flushed). Python's `random` is reseeded by the fork itself; torch and numpy
generators are whatever the imports left (the trainer seeds its own).

Nothing outlives the launcher: the server gets SIGTERM when the launcher's thread that started it ends
(PR_SET_PDEATHSIG), also on kill -9, and each child gets SIGTERM when the server ends. The server reports each
child's exit status (a negative signal number if it was killed, as `Popen.returncode`) on its control pipe;
`Forked` is the part of `Popen`'s interface the launchers use.

The control pipe carries one JSON object per line: requests on the server's stdin
`{"id", "module" | "script", "argv", "cwd", "env", "stdout", "stderr"}`, answers on its stdout
`{"ready": pid}`, `{"id", "pid"}` and `{"exit": pid, "code"}`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

PR_SET_PDEATHSIG = 1  # linux/prctl.h
PRELOAD = ("peers.node", "peers.join", "peers.local_swarm", "swarm.train.trainer", "swarm.net.peer",
           "swarm.net.dht", "matplotlib.pyplot", "torch.distributed.fsdp")
"""What every kind of peer imports on its way to training (matplotlib: the summary's loss plot; FSDP: ~2 s, what
each rank of a sharded peer would import at once otherwise, swarm/train/sharding.py). Not the modules
that children run (`swarm.cli`): `runpy` runs those afresh, as `python -m` does. bitsandbytes too where it is safe
(`_preload_bitsandbytes`)."""
START_TIMEOUT_S = 120.0  # the server imports for ~4 s on an idle 2-core machine; past this it is broken
REAP_INTERVAL_S = 0.05  # how often the server looks for children that exited


class ForkServerError(RuntimeError):
    pass


def die_with(parent: int) -> None:
    """Ask the kernel for a SIGTERM when our parent ends (at once if it already did). Linux only."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


class Forked:
    """A child of the fork server, with `subprocess.Popen`'s `pid`, `returncode`, `poll`, `wait`, `send_signal`,
    `terminate` and `kill`."""

    def __init__(self, server: ForkServer, pid: int):
        self.server, self.pid = server, pid

    @property
    def returncode(self) -> Optional[int]:
        return self.server.exit_code(self.pid)

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self.server.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # it exited and the server has not reported it yet

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's end: starts the server process (its imports run in the background) and forks children
    through it. Create it, and call `spawn`, from the main thread (see PR_SET_PDEATHSIG above)."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD):
        launcher = os.getpid()
        # the server imports the same code as this launcher, whatever folder the launcher runs in
        code_root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [code_root, os.environ.get("PYTHONPATH")]))}
        if _imported(preload):  # this launcher has imported it all (a child of a fork server): fork the server
            self._proc = _ServerFork(preload, launcher)
        else:
            self._proc = subprocess.Popen([sys.executable, "-m", "peers.forkserver", *preload],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                                          env=env, preexec_fn=lambda: die_with(launcher))
        self._cond = threading.Condition()
        self._ready: Optional[int] = None
        self._pids: dict[int, int] = {}  # request id -> pid
        self._codes: dict[int, int] = {}  # pid -> exit status
        self._lost: Optional[str] = None  # why the server is gone, once it is
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._cond:
                if "ready" in message:
                    self._ready = message["ready"]
                elif "exit" in message:
                    self._codes[message["exit"]] = message["code"]
                else:
                    self._pids[message["id"]] = message["pid"]
                self._cond.notify_all()
        with self._cond:
            self._lost = f"the fork server exited with status {self._proc.wait()}"
            self._cond.notify_all()

    def spawn(self, argv: list[str], stdout: Path, stderr: Optional[Path] = None, module: str = "swarm.cli",
              script: Optional[Path] = None, cwd: Optional[Path] = None, env: Optional[dict] = None) -> Forked:
        """`python -m module argv` (or `python script argv`) in a forked child writing to `stdout` (and `stderr`,
        default: the same file)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready is not None or self._lost, START_TIMEOUT_S):
                raise ForkServerError(f"the fork server did not start within {START_TIMEOUT_S:.0f} s")
            if self._lost:
                raise ForkServerError(self._lost)
            self._next_id += 1
            request = {"id": self._next_id, "argv": list(argv), "cwd": str(cwd or os.getcwd()),
                       "env": dict(os.environ if env is None else env), "stdout": str(stdout),
                       "stderr": str(stderr or stdout), **({"script": str(script)} if script else {"module": module})}
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
            if not self._cond.wait_for(lambda: request["id"] in self._pids or self._lost, START_TIMEOUT_S):
                raise ForkServerError("the fork server did not answer a request")
            if self._lost:
                raise ForkServerError(self._lost)
            return Forked(self, self._pids.pop(request["id"]))

    def exit_code(self, pid: int) -> Optional[int]:
        with self._cond:
            return self._codes.get(pid)

    def wait_exit(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._codes or self._lost, timeout)
            if pid not in self._codes and self._lost:
                raise ForkServerError(f"{self._lost} before child {pid} did")
            return self._codes.get(pid)

    def close(self) -> None:
        """Stop the server: children still running get SIGTERM."""
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._reader.join(5)
        self._proc.stdout.close()


def _imported(preload: tuple[str, ...]) -> bool:
    """The server may be forked from this process: it imported what the server would, and runs no other thread
    that a fork could catch holding a lock (a `swarm local` forked from the fork server of `make test`, or of
    another launcher, saves the server's ~4 s of imports)."""
    return threading.active_count() == 1 and all(name in sys.modules for name in preload)


class _ServerFork:
    """The server forked from the launcher instead of started afresh: the part of `Popen`'s interface `ForkServer`
    uses (`stdin`, `stdout`, `poll`, `wait`, `kill`). The server gets what `Popen` would give it: a session of
    its own, SIGTERM when the launcher ends, the pipes on stdin and stdout, default signal handlers and no log
    handler of the launcher's. It keeps the launcher's other open files: what the imports opened (an event
    loop's epoll, say) is among them, and closing those breaks the children (hivemind's DHT process could not
    poll its pipe)."""

    def __init__(self, preload: tuple[str, ...], launcher: int):
        requests, answers = os.pipe(), os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                from swarm.run import logs

                os.setsid()
                die_with(launcher)
                for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):  # the launcher's own handlers
                    signal.signal(sig, signal.SIG_DFL)
                logs.forget()
                os.dup2(requests[0], 0)
                os.dup2(answers[1], 1)
                for fd in (*requests, *answers):
                    os.close(fd)
                main(list(preload))
            finally:
                os._exit(0)  # never back into the launcher's code
        os.close(requests[0])
        os.close(answers[1])
        self.pid, self.returncode = pid, None
        self.stdin, self.stdout = os.fdopen(requests[1], "wb"), os.fdopen(answers[0], "rb")
        self._lock = threading.Lock()  # the reader thread and close() both wait for it

    def poll(self) -> Optional[int]:
        with self._lock:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("fork server", timeout)
            time.sleep(REAP_INTERVAL_S)
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


# ---- the server process ------------------------------------------------------------------------------

def _send(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _own_process_locks() -> None:
    """Give the child the process-shared locks a fresh interpreter would create at import. hivemind creates
    `MPFuture`'s locks when it is imported, here once in the server, so that without this every child would share
    them: one child's DHT process killed while it reports (holding the lock) would block every other child's
    DHT and averager start-up, in this test or the next."""
    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()


def _child(request: dict, server: int) -> None:
    """In the forked child: become what `python -m module argv` in a new session would be, then run it. Never
    returns: it ends the interpreter like a fresh one ends."""
    os.setsid()
    die_with(server)
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _own_process_locks()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = out if request["stderr"] == request["stdout"] else os.open(
        request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    for fd in {null, out, err}:
        os.close(fd)
    sys.stdin = open(os.devnull)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import runpy

    try:
        if "script" in request:
            sys.argv = [request["script"], *request["argv"]]
            sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
            runpy.run_path(request["script"], run_name="__main__")
        else:
            sys.argv = [request["module"], *request["argv"]]
            sys.path[0] = os.getcwd()
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):  # sys.exit("message"): printed, status 1
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # what the interpreter prints for an uncaught exception, and its status
        traceback.print_exc()
        code = 1
    _end(code)


def _end(code: int) -> None:
    """End the child as the interpreter ends (non-daemon threads joined, atexit handlers run, streams flushed),
    with status `code` (negative: killed by that signal, as Python ends on an uncaught KeyboardInterrupt), and
    without unwinding into the frames it was forked from: a server forked from a launcher (`_ServerFork`)
    holds the launcher's frames, whose `finally` blocks must not run in its children."""
    threading._shutdown()  # what Py_FinalizeEx and multiprocessing's children do first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a stream already closed has nothing left to flush
            stream.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


class _Requests:
    """Lines from the launcher on stdin, read with os.read so that `select` sees what is not consumed yet."""

    def __init__(self):
        self.buffer = b""

    def next(self, timeout: float) -> Optional[dict]:
        if b"\n" not in self.buffer:
            readable, _, _ = select.select([0], [], [], timeout)
            if not readable:
                return None
            data = os.read(0, 65536)
            if not data:  # the launcher closed the pipe, or died
                raise SystemExit(0)
            self.buffer += data
            if b"\n" not in self.buffer:
                return None
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


def _reap(children: set[int]) -> None:
    """Report the children that exited."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _preload_bitsandbytes() -> None:
    """Import what the default int8 codec uses (swarm/net/codec.py), which every peer would otherwise import on its
    first exchange at a cost of seconds (it wraps its kernels in torch.compile at import), only where torch is a CPU
    build: on a CUDA or ROCm build the import asks the driver for its devices, and children forked after that
    cannot use CUDA. Its warning about 4-bit kernels from the hub (none are used) would go to the launcher's
    terminal from here: it is dropped."""
    import torch

    if torch.version.cuda is not None or torch.version.hip is not None:
        return
    quiet = logging.NullHandler()
    logging.getLogger("bitsandbytes").addHandler(quiet)
    try:
        importlib.import_module("bitsandbytes.functional")
    finally:
        logging.getLogger("bitsandbytes").removeHandler(quiet)


def main(preload: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C; we report how children end
    os.environ.setdefault("MPLBACKEND", "Agg")
    for name in preload:
        importlib.import_module(name)
    _preload_bitsandbytes()
    # What the imports made lives as long as every child: the children's garbage collector leaves it alone, and
    # so never walks the objects each child shares with us (nor copies their pages, which a walk writes).
    gc.freeze()
    children: set[int] = set()

    def stop(*_) -> None:
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    me, requests = os.getpid(), _Requests()
    _send({"ready": me})
    try:
        while True:
            _reap(children)
            request = requests.next(REAP_INTERVAL_S)
            if request is None:
                continue
            pid = os.fork()
            if pid == 0:
                _child(request, me)
            children.add(pid)
            _send({"id": request["id"], "pid": pid})
    except SystemExit:
        if os.getpid() != me:
            raise  # a child's own exit
        stop()


if __name__ == "__main__":
    main(sys.argv[1:])
