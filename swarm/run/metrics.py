"""Where a peer's per-round metrics go: metrics.csv always (swarm/run/report.py), TensorBoard and W&B on request.

- `logging.tensorboard: true`: TensorBoard event files in `<out>/tensorboard` (torch's SummaryWriter; needs the
  `tensorboard` package, `pip install 'swarm[tensorboard]'`), one scalar per column of metrics.csv that is a
  number, against the peer's inner step; a resumed peer appends a new event file to the same folder.
- `logging.wandb: PROJECT`: one W&B run per peer folder (its id kept in `<out>/wandb-id.txt`, so a resumed peer
  goes on with the same W&B run), the run's config attached; `logging.wandb_mode: offline` keeps it in
  `<out>/wandb` for a later `wandb sync`. Needs `pip install 'swarm[wandb]'`.

A sink that is asked for but cannot be imported is a UsageError at start (exit 2), before any training.
"""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path
from typing import Any, Optional

from swarm.config import Config, shared_config
from swarm.errors import UsageError
from swarm.run.report import append_metrics
from swarm.train.history import RoundRecord

SCALARS = {
    "train_loss": "loss/train", "eval_loss": "loss/eval", "tokens_per_s": "speed/tokens_per_s",
    "compute_s": "time/compute_s", "comm_s": "time/comm_s", "wait_s": "time/wait_s", "overhead_s": "time/overhead_s",
    "bytes_sent": "traffic/bytes_sent", "bytes_received": "traffic/bytes_received", "group_size": "swarm/group_size",
    "round": "swarm/round", "committed": "swarm/committed",
}
"""metrics.csv columns (report.METRICS_COLUMNS) sent to TensorBoard and W&B, and their names there."""


def check_available(cfg: Config) -> None:
    """UsageError naming the key whose package is missing."""
    for key, module, extra in (("tensorboard", "tensorboard", "tensorboard"), ("wandb", "wandb", "wandb")):
        if getattr(cfg.logging, key) and importlib.util.find_spec(module) is None:
            raise UsageError(f"logging.{key} needs the {module} package: pip install 'swarm[{extra}]'")


def scalars(record: RoundRecord) -> dict[str, float]:
    """The numbers of one round, by their TensorBoard / W&B names (None values left out)."""
    values = record.__dict__
    return {name: float(values[column]) for column, name in SCALARS.items() if values.get(column) is not None}


class Metrics:
    """Every sink of one peer; `round` after each closed round, `close` once training stops."""

    def __init__(self, cfg: Config, out_dir: Path, name: str = ""):
        check_available(cfg)
        self.csv = out_dir / "metrics.csv"
        self.tensorboard: Any = None
        self.wandb: Any = None
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        if cfg.logging.wandb:
            self.wandb = _wandb_run(cfg, out_dir, name)

    def round(self, record: RoundRecord, inner_step: int) -> None:
        append_metrics(self.csv, record, inner_step)
        values = scalars(record)
        if self.tensorboard is not None:
            for name, value in values.items():
                self.tensorboard.add_scalar(name, value, global_step=inner_step, walltime=record.time)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log({**values, "inner_step": inner_step}, step=inner_step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            import wandb

            self.wandb.finish()
            self.wandb = None
            wandb.teardown()  # stops the wandb-core service this process started


def _wandb_run(cfg: Config, out_dir: Path, name: str) -> Any:
    import wandb

    out_dir.mkdir(parents=True, exist_ok=True)
    id_file = out_dir / "wandb-id.txt"
    run_id: Optional[str] = id_file.read_text().strip() if id_file.exists() else None
    if not run_id:
        run_id = uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
    return wandb.init(project=cfg.logging.wandb, name=name or None, group=cfg.swarm.run_id, id=run_id,
                      resume="allow", dir=str(out_dir), mode=cfg.logging.wandb_mode, config=shared_config(cfg))
