"""Shared helpers: a tiny config that trains in seconds, ways to run the `swarm` CLI (in a process of its own,
or in this one), a solo run stopped after a round and resumed, and the `slow` mark `make test-fast` leaves out."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import torch

from peers.forkserver import ForkServer
from swarm.config import Config
from swarm.run.configfile import load_config
from swarm.train.averaging import ExchangeOutcome, SoloAverager

ROOT = Path(__file__).resolve().parent.parent

# `make test-fast` (`pytest -m "not slow"`) runs the tests that start no other process, in about a minute. A test
# is `slow` when its module says so (`pytestmark = pytest.mark.slow`: it starts peers, DHTs or `swarm` processes),
# when it is marked `@pytest.mark.slow` itself, or when it takes one of the fixtures that start such processes
# (SLOW_FIXTURES). `make test` runs every test.
SLOW_FIXTURES = {"bootstrap", "cli", "dhts", "fork_server", "pair", "peers", "stock_bootstrap", "swarm_cmd"}

# `make test` runs the suite on two workers (pytest-xdist, `-n 2 --maxschedchunk 2`: each takes the next test as it
# frees up). The modules that take longest go first, so that the two end together rather than one waiting for a
# long test that started last: their seconds, as `make durations` last measured them, are in DURATIONS (a module
# not there, a new one, goes after those measured).
DURATIONS = ROOT / "tests" / "durations.json"


def pytest_addoption(parser) -> None:
    parser.addoption("--store-durations", action="store_true",
                     help="write each test module's total seconds to tests/durations.json (`make durations`)")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if SLOW_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
    try:
        seconds = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        seconds = {}
    items.sort(key=lambda item: -float(seconds.get(item.nodeid.partition("::")[0], 0.0)))  # stable


_measured: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    _measured[report.nodeid.partition("::")[0]] = _measured.get(report.nodeid.partition("::")[0], 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus) -> None:
    if session.config.getoption("--store-durations") and not os.environ.get("PYTEST_XDIST_WORKER") and _measured:
        DURATIONS.write_text(json.dumps({k: round(v, 1) for k, v in sorted(_measured.items())}, indent=1) + "\n")


def tiny_config(**sections) -> Config:
    """configs/tiny.yaml shrunk to a model and data that train in a second or two."""
    overrides = {
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "max_seq_len": 32},
        "data": {"seq_len": 32, "batch_size": 4, "eval_batches": 2, "max_documents": 60},
        "inner": {"warmup_steps": 2},
        "diloco": {"rounds": 3, "inner_steps": 4, "delay": 0, "threads": 1},  # overlap: where a test asks for it
        "logging": {"progress_bar": False},
        "swarm": {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"]},  # tests stay on loopback
    }
    for name, values in sections.items():
        overrides.setdefault(name, {}).update(values)
    return load_config(ROOT / "configs" / "tiny.yaml", overrides)


def scratch_folder(tmp_path_factory=None) -> Path:
    """A fresh folder to run `swarm` commands in that shows the repository's configs/ and bench/: what a peer
    without `--out` writes (runs/) lands there, never in the repository."""
    folder = tmp_path_factory.mktemp("cwd") if tmp_path_factory else Path(tempfile.mkdtemp(prefix="swarm-cwd-"))
    for name in ("configs", "bench"):
        (folder / name).symlink_to(ROOT / name)
    return folder


def run_cli(*args: str, timeout: float = 120, cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """`python -m swarm.cli ARGS` in a fresh interpreter (by default in a scratch folder): for what the fork
    server does not give (an interpreter that has imported nothing yet)."""
    return subprocess.run([sys.executable, "-m", "swarm.cli", *args], cwd=cwd or scratch_folder(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="session")
def fork_server(token_cache):
    """One fork server for the session (peers/forkserver.py): every peer and `swarm` command a test starts is
    forked from it instead of importing torch and hivemind again."""
    server = ForkServer()
    yield server
    server.close()


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, whatever session it started (a local swarm's peers, their ranks)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo.extend(children.get(out[-1], []))
    return out


@pytest.fixture
def swarm_cmd(fork_server, tmp_path_factory):
    """`swarm ARGS` forked from the session's fork server, waited for: a CompletedProcess (stdout, stderr
    text). SIGKILLed past `timeout`, failing the test with the end of its stderr."""
    def run(*args: str, timeout: float = 120, cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
        cwd = cwd or scratch_folder(tmp_path_factory)
        folder = tmp_path_factory.mktemp("cmd")
        out, err = folder / "stdout", folder / "stderr"
        child = fork_server.spawn(list(args), out, err, cwd=cwd)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in descendants(child.pid):  # each writes its threads' stacks to its stderr (swarm/cli.py)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
            time.sleep(2.0)
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            pytest.fail(f"swarm {' '.join(args)}: still running after {timeout}s; its stderr, with the stacks of "
                        f"its processes, ends:\n{err.read_text()[-12000:]}")
        return subprocess.CompletedProcess(["swarm", *args], code, out.read_text(), err.read_text())
    return run


class LostExceptions(logging.Handler):
    """asyncio's reports of a task or future that ended with an exception nobody took (swarm/net/tasks.py)."""

    def __init__(self):
        super().__init__()
        self.lost: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "exception was never retrieved" in record.getMessage():
            self.lost.append(f"{record.getMessage()[:400]}: {record.exc_info[1]!r}" if record.exc_info else
                             record.getMessage()[:400])


@pytest.fixture(scope="session", autouse=True)
def frozen_imports():
    """What the imports made is never garbage: the garbage collector leaves it alone from here on, so that
    `no_lost_exceptions` collects a test's garbage in a millisecond rather than 0.15 s."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_worker():
    """On several workers (`make test`: one per core), torch computes on one thread in each worker and in every
    process it starts (OMP_NUM_THREADS, read by the fork server's torch and so by every peer forked from it, unless
    a test sets `diloco.threads`): two threads each would oversubscribe the cores, and a test that trains waits on
    threads that another process holds (the 150M recipe's inner steps: 7 s alone, 40 s beside a worker on 2).
    Likewise each p2pd daemon runs Go on one thread (GOMAXPROCS): dozens of daemons at once, each with a thread
    per core looking for work, spend CPU the tests need."""
    threads, saved = torch.get_num_threads(), {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "GOMAXPROCS")}
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        torch.set_num_threads(1)
        os.environ.update(OMP_NUM_THREADS="1", GOMAXPROCS="1")
    yield
    torch.set_num_threads(threads)
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def no_lost_exceptions(frozen_imports):
    """A test fails that leaves an asyncio task or future with an exception nobody took: collected now, at the
    end of the test that made it, rather than by chance later, in another test (where CPython 3.11.7 may fail an
    unrelated `ast.parse` over it: swarm/net/tasks.py)."""
    lost = LostExceptions()
    logging.getLogger("asyncio").addHandler(lost)
    try:
        yield
        gc.collect()
    finally:
        logging.getLogger("asyncio").removeHandler(lost)
    assert not lost.lost, f"left exceptions nobody took: {lost.lost}"


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory):
    """Prepared corpora (swarm/data/tokens.py) go to one folder of this session, shared by the peers it starts, never
    to the user's ~/.cache."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # under xdist: one cache for the session's workers
    folder = (tmp_path_factory.getbasetemp().parent / "token-cache" if worker else
              tmp_path_factory.mktemp("token-cache"))
    folder.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(folder))
        yield folder


@dataclass
class CliResult:
    """What a `swarm` command called in this process left: its exit code and what it printed."""
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys, monkeypatch, tmp_path_factory):
    """`swarm.cli.main(args)` in this process, as a `CliResult`: for tests of an exit code and an error line, which
    would otherwise spend most of their time starting an interpreter and importing torch and hivemind. It runs
    in a folder of its own that shows the repository's configs/ (so `runs/`, where a peer without `--out`
    writes, is never the repository's). A peer command sets the SIGTERM handler and torch's thread count: both
    are restored afterwards."""
    from swarm.cli import main

    monkeypatch.chdir(scratch_folder(tmp_path_factory))
    sigterm, threads = signal.getsignal(signal.SIGTERM), torch.get_num_threads()

    def call(*args: str) -> CliResult:
        capsys.readouterr()
        try:
            with pytest.raises(SystemExit) as exited:
                main(list(args))
        finally:
            signal.signal(signal.SIGTERM, sigterm)
            torch.set_num_threads(threads)
        out, err = capsys.readouterr()
        return CliResult(exited.value.code, out, err)
    return call


@pytest.fixture
def tiny() -> Config:
    return tiny_config()


class Interrupt(Exception):
    pass


def resumed_after(cfg: Config, out_dir: Path, stop_round: int):
    """A solo Trainer stopped (by an exception, as a crash would) once round `stop_round` committed, then a
    fresh Trainer on the same folder trained to the end: returned, to compare with an uninterrupted run of peer
    "a" (the same identity: it seeds the batch order, swarm/data/batches.py)."""
    from swarm.train.averaging import SoloAverager
    from swarm.train.trainer import Trainer

    def stop(record) -> None:
        if record.round == stop_round:
            raise Interrupt

    with pytest.raises(Interrupt):
        Trainer(cfg, SoloAverager(), "a", shard=0, out_dir=out_dir, on_round=stop).train()
    resumed = Trainer(cfg, SoloAverager(), "a", shard=0, out_dir=out_dir)
    resumed.train()
    return resumed


class DiscardsOnce(SoloAverager):
    """Discards the first exchange keyed `round` (the outer steps committed before it: with diloco.fragments,
    one per committed fragment exchange), as a group that lost a member would."""

    def __init__(self, round: int):
        self.round, self.discarded = round, False

    def average(self, round, pseudo_grad, samples, out, base=""):
        if round == self.round and not self.discarded:
            self.discarded = True
            return ExchangeOutcome(None, note="injected discard")
        return super().average(round, pseudo_grad, samples, out, base)
