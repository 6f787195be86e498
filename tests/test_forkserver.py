"""peers/forkserver.py: a launcher that is itself a child of a fork server (`swarm local` under `make test`) forks
its own server instead of importing everything again; its children end as a fresh interpreter's would."""

import textwrap
from pathlib import Path

import pytest

CHILD = """
import os, sys
if sys.argv[1:] == ["grandchild"]:  # a child that forks and reports its own child's status
    pid = os.fork()
    if pid == 0:
        os.kill(os.getpid(), 9)
    print("grandchild", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
if sys.argv[1:] == ["raise"]:
    raise ValueError("uncaught")
sys.exit(3)
"""

LAUNCHER = """
import sys
from pathlib import Path
from peers.forkserver import ForkServer

folder = Path(sys.argv[1])
try:
    server = ForkServer()
    for name, args in (("exit", []), ("grandchild", ["grandchild"]), ("raise", ["raise"])):
        child = server.spawn(args, folder / f"{name}.out", script=folder / "child.py")
        print(name, child.wait(60), flush=True)
    server.close()
finally:
    print("launcher finally", flush=True)  # once: never in the children of the server it forked
"""


@pytest.mark.timeout(120)
def test_a_launcher_forked_from_a_fork_server_forks_its_own_and_its_children_end_as_interpreters_do(
        tmp_path: Path, fork_server):
    (tmp_path / "child.py").write_text(textwrap.dedent(CHILD))
    (tmp_path / "launcher.py").write_text(textwrap.dedent(LAUNCHER))
    launcher = fork_server.spawn([str(tmp_path)], tmp_path / "launcher.out", script=tmp_path / "launcher.py",
                                 cwd=Path(__file__).resolve().parents[1])
    assert launcher.wait(100) == 0, (tmp_path / "launcher.out").read_text()
    lines = (tmp_path / "launcher.out").read_text().splitlines()
    assert lines[:3] == ["exit 3", "grandchild 3", "raise 1"], lines
    assert (tmp_path / "grandchild.out").read_text().strip() == "grandchild -9"
    assert "ValueError: uncaught" in (tmp_path / "raise.out").read_text()
    assert lines.count("launcher finally") == 1 and len(lines) == 4
