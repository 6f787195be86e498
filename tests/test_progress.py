"""What a peer shows while it trains (swarm/progress.py)."""

import logging

from swarm.progress import Progress, clock
from tests.conftest import tiny_config


def test_a_plain_line_every_progress_every_seconds_with_speed_and_time_left(caplog):
    cfg = tiny_config(diloco={"rounds": 3, "inner_steps": 4}, logging={"progress_every": 10.0})  # 4 x 32 tokens
    shown = Progress(cfg, "p", live=False)
    caplog.set_level(logging.INFO, "swarm.progress")
    texts = [shown.step(0, i + 1, 2.5, i + 1, now=100.0 + 2 * i) for i in range(4)]  # 2 s per inner step
    assert texts[0] == ("round 1/3, inner step 1/4, loss 2.5000, ? tokens/s, round ends in ?, run in ?")
    assert texts[3] == "round 1/3, inner step 4/4, loss 2.5000, 64 tokens/s, round ends in 0:00, run in 0:16"
    shown.step(1, 1, 2.0, 5, now=120.0)  # a round boundary that took 12 s (communication): the run's pace counts it
    assert shown.describe(1, 1, 2.0, 5, 120.0).endswith("run in 0:35")
    lines = [r.getMessage() for r in caplog.records if r.name == "swarm.progress"]
    assert lines == [texts[0], shown.describe(1, 1, 2.0, 5, 120.0)]  # at 100 s, then not before 110 s
    assert clock(3725) == "1:02:05" and clock(65) == "1:05"
    shown.close()
