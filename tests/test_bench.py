"""`make bench-quick` never overwrites the committed full-run results in bench/results."""

import subprocess
import sys

import pytest

from bench.common import QUICK_RESULTS, RESULTS
from tests.conftest import ROOT


@pytest.mark.timeout(120)
def test_a_quick_run_writes_beside_the_committed_results():
    committed = {p.name: p.read_bytes() for p in RESULTS.iterdir() if p.is_file()}
    result = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--only", "compression"], cwd=ROOT,
                            capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in RESULTS.iterdir() if p.is_file()} == committed
    assert '"quick": true' in (QUICK_RESULTS / "compression.json").read_text()
    assert "quick run" in (QUICK_RESULTS / "README.md").read_text()
