"""What a training peer shows while it trains: round, inner step, loss, tokens/s, and the time left in the round
and in the run.

On a terminal (and `logging.progress_bar`) it is a live bar; otherwise (a log file, `swarm local`'s
children, a service) one plain log line every `logging.progress_every` seconds, so a peer whose rounds
last 40 minutes still says where it is. Speeds are measured, not configured: tokens/s over the last inner
steps, and the run's time left from the wall time per inner step so far (communication included).
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import ExitStack
from typing import Callable, Optional

from swarm.config import Config

log = logging.getLogger("swarm.progress")
WINDOW = 20  # inner steps the tokens/s and a round's time left are measured over


def clock(seconds: Optional[float]) -> str:
    """`1:02:03` (or `2:03`) for a duration; `?` before anything was measured."""
    if seconds is None:
        return "?"
    seconds = int(max(0.0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """Called after every inner step (`step`), closed once training stops."""

    def __init__(self, cfg: Config, name: str, live: Optional[bool] = None):
        self.rounds, self.inner_steps = cfg.diloco.rounds, cfg.diloco.inner_steps
        self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        self.every, self.name = cfg.logging.progress_every, name
        self.live = cfg.logging.progress_bar and sys.stderr.isatty() if live is None else live
        self.times: list[float] = []  # when the last WINDOW inner steps ended
        self.start: Optional[tuple[float, int]] = None  # (time, total inner steps) of the first step seen
        self.last_line = 0.0
        self.stack = ExitStack()
        self.bar = None
        if self.live:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.stack.enter_context(logging_redirect_tqdm())
            self.bar = self.stack.enter_context(tqdm(total=self.rounds * self.inner_steps, desc=name, unit="step",
                                                     dynamic_ncols=True))

    def step(self, round: int, inner: int, loss: float, total: int, now: Optional[float] = None) -> str:
        """After inner step `inner` of round `round` + 1 (`total` inner steps done in the run): refresh the bar,
        or log a line if `every` seconds passed. Returns the text shown."""
        now = time.monotonic() if now is None else now
        self.times = [*self.times[-WINDOW:], now]
        if self.start is None:
            self.start = (now, total)
        text = self.describe(round, inner, loss, total, now)
        if self.bar is not None:
            self.bar.n = total
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.refresh()
        elif now - self.last_line >= self.every:
            self.last_line = now
            log.info("%s", text)
        return text

    def describe(self, round: int, inner: int, loss: float, total: int, now: float) -> str:
        step_s = (self.times[-1] - self.times[0]) / (len(self.times) - 1) if len(self.times) > 1 else None
        tokens = f"{self.tokens_per_step / step_s:.0f}" if step_s else "?"
        round_left = (self.inner_steps - inner) * step_s if step_s else None
        started, done = self.start or (now, total)
        wall_per_step = (now - started) / (total - done) if total > done else None
        run_left = (self.rounds * self.inner_steps - total) * wall_per_step if wall_per_step else None
        return (f"round {round + 1}/{self.rounds}, inner step {inner}/{self.inner_steps}, loss {loss:.4f}, "
                f"{tokens} tokens/s, round ends in {clock(round_left)}, run in {clock(run_left)}")

    def close(self) -> None:
        self.stack.close()


class PrepareProgress:
    """What preparing a corpus shows (`swarm data prepare`, or a peer preparing its own): text read, documents,
    tokens, speed and time left, against `total_bytes()` (the input's size, `swarm.data.batches.input_bytes`, asked when
    tokenizing starts; None where unknown: no time left). A live bar on a terminal, else a log line every `every`
    seconds. Called as the `progress(documents, tokens, text)` of `swarm.data.batches.load_corpus`; shows nothing until
    first called (a corpus already prepared shows nothing)."""

    def __init__(self, what: str, total_bytes: Callable[[], Optional[int]], live: Optional[bool] = None,
                 every: float = 30.0):
        self.what, self.total_bytes, self.every = what, total_bytes, every
        self.total: Optional[int] = None
        self.live = sys.stderr.isatty() if live is None else live
        self.bar = None
        self.start: Optional[float] = None
        self.last_line = 0.0

    def __call__(self, documents: int, tokens: int, text: int, now: Optional[float] = None) -> str:
        now = time.monotonic() if now is None else now
        if self.start is None:
            self.start, self.last_line, self.total = now, now, self.total_bytes()
            if self.live:
                from tqdm import tqdm

                self.bar = tqdm(desc=self.what, total=self.total, unit="B", unit_scale=True, dynamic_ncols=True)
        speed = text / (now - self.start) if now > self.start else None
        left = (self.total - text) / speed if speed and self.total else None
        of = f" of {self.total / 1e6:.0f} MB ({100 * min(text / self.total, 1):.0f}%)" if self.total else ""
        line = (f"{self.what}: {text / 1e6:.0f} MB of text{of}, {documents} documents, {tokens / 1e6:.1f}M tokens, "
                f"{speed / 1e6 if speed else 0:.1f} MB/s, done in {clock(left) if self.total else '?'}")
        if self.bar is not None:
            self.bar.update(text - self.bar.n)
            self.bar.set_postfix_str(f"{documents} docs, {tokens / 1e6:.1f}M tokens", refresh=False)
        elif now - self.last_line >= self.every:
            self.last_line = now
            log.info("%s", line)
        return line

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
