"""`python -m bench.run [--quick] [--only NAME ...]`: run the benchmarks, write bench/results/<name>.json and
bench/results/README.md (one markdown table per benchmark), and print the tables. A `--quick` run writes the
same files under runs/bench-quick/ instead, so it never replaces the committed full-run results.

Each benchmark is a module `bench/<name>.py` with `run(quick: bool) -> dict` holding a markdown 'table'
(a `main`/`run` without arguments, or returning something else, is adapted). A module that is absent, or that
sets `NEEDS_CUDA` on a machine without CUDA, is skipped with a note (its committed results stay); one that
fails is recorded with its error and the suite goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import io
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.common import commit, results_dir, stamp

MODULES = ["convergence", "traffic", "utilization", "overhead", "allreduce", "scale", "compression", "hostile", "data",
           "churn", "shards", "gpu", "linkspeed", "quantized"]
TITLES = {"convergence": "1. Convergence (DiLoCo Table 2 shape)", "traffic": "2. Traffic per round",
          "utilization": "3. Compute utilization of a real swarm",
          "overhead": "4. Overhead: swarm peer --solo vs plain PyTorch",
          "allreduce": "5. All-reduce time", "scale": "6. The round at real model sizes (85M parameters)",
          "compression": "Compression codecs (bench/compression.py)",
          "hostile": "7. Hostile peers: one attacker in a local swarm of 4",
          "data": "8. Prepared corpora: prepare, a peer's memory and start-up, the loader",
          "churn": "9. Churn soak: peers killed -9 and restarted, newcomers, and where the finishers end",
          "shards": "10. Sharded peers (inner.parallel fsdp): peak memory per rank",
          "gpu": "11. On one GPU: the 150M recipe against plain PyTorch, and two peers sharing the GPU",
          "linkspeed": "12. The exchange at link speed: all-reduce MB/s per peer against raw TCP",
          "quantized": "13. Quantized by default: a real swarm's eval loss by compression"}


def call(name: str, quick: bool) -> dict:
    module = importlib.import_module(f"bench.{name}")
    fn = getattr(module, "run", None) or getattr(module, "main", None)
    if fn is None:
        raise RuntimeError(f"bench/{name}.py has neither run() nor main()")
    params = inspect.signature(fn).parameters
    captured, argv = io.StringIO(), sys.argv
    sys.argv = [f"bench.{name}"] + (["--quick"] if quick else [])  # for a main() that parses sys.argv itself
    try:
        with contextlib.redirect_stdout(Tee(captured, sys.stdout)):
            if "quick" in params:
                out = fn(quick=quick)
            elif params:
                out = fn(sys.argv[1:])
            else:
                out = fn()
    finally:
        sys.argv = argv
    if isinstance(out, dict) and "table" in out:
        return out
    # A main() that prints its table and writes its own json: keep that json, take the table from stdout.
    own = results_dir(quick) / f"{name}.json"
    result = json.loads(own.read_text()) if own.exists() else {}
    result = result if isinstance(result, dict) else {"returned": result}
    if isinstance(out, dict):
        result.update(out)
    lines = captured.getvalue().splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("|")]
    table = "\n".join(lines[max(0, rows[0] - 2): rows[-1] + 1]).strip() if rows else captured.getvalue().strip()
    result["table"] = table or "(no table printed)"
    return result


class Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


def write_readme(results: Path) -> str:
    parts = ["# Benchmark results\n", "Written by `python -m bench.run`; raw numbers, configs and timestamps in "
             "the `<name>.json` files next to this one.\n"]
    for name in MODULES:
        path = results / f"{name}.json"
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        mode = "quick" if result.get("quick") else "full"
        parts.append(f"## {TITLES.get(name, name)}\n\n_{mode} run, {result.get('started')}, "
                     f"{result.get('wall_s', 0):.0f} s, commit {result.get('commit', 'not recorded')}_\n\n"
                     f"{result['table']}\n")
    text = "\n".join(parts)
    (results / "README.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings: the whole suite in a few minutes")
    parser.add_argument("--only", nargs="+", choices=MODULES, default=None, metavar="NAME",
                        help=f"run only these benchmarks ({', '.join(MODULES)})")
    args = parser.parse_args(argv)
    results = results_dir(args.quick)
    results.mkdir(parents=True, exist_ok=True)
    suite_start, failed = time.time(), []
    for name in args.only or MODULES:
        if importlib.util.find_spec(f"bench.{name}") is None:
            print(f"== {name}: skipped, bench/{name}.py does not exist (yet)", flush=True)
            continue
        if getattr(importlib.import_module(f"bench.{name}"), "NEEDS_CUDA", False) and not torch.cuda.is_available():
            print(f"== {name}: skipped, it needs a CUDA device (its committed results stay)", flush=True)
            continue
        print(f"== {name} ({'quick' if args.quick else 'full'})", flush=True)
        started, start = stamp(), time.time()
        try:
            result = call(name, args.quick)
        except Exception as e:  # one broken benchmark must not take the others down
            traceback.print_exc()
            failed.append(name)
            result = {"table": f"**failed**: `{type(e).__name__}: {e}`", "error": traceback.format_exc()}
        result.update(name=name, quick=args.quick, started=started, finished=stamp(), wall_s=time.time() - start,
                      commit=commit())
        (results / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
        print(f"{result['table']}\n({name}: {result['wall_s']:.0f} s)\n", flush=True)
    write_readme(results)
    print(f"suite: {time.time() - suite_start:.0f} s; results in {results}/"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
