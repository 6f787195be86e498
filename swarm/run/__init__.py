"""Running a peer from the command line: arguments, config files, run identity, and what a run leaves behind.

- `cliargs.py`: every command, option and help text (swarm/cli.py runs them).
- `configfile.py`: a `Config` (swarm/config.py) from YAML and dotted overrides; `configdoc.py`: docs/config.md.
- `runid.py`: what every peer of a run shares, and its fingerprint.
- `logs.py`: where log lines go; `progress.py`: what a training peer shows while it trains.
- `metrics.py`: per-round metrics (metrics.csv, TensorBoard, W&B); `report.py`: summary.json, metrics.csv, loss.png.
"""
