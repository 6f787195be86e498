"""What a peer shows while it trains (swarm/run/progress.py)."""

import logging

from swarm.run.progress import PrepareProgress, Progress, clock
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


def test_preparing_a_corpus_shows_text_read_speed_and_time_left(caplog):
    asked = []
    shown = PrepareProgress("tokenizing c", lambda: asked.append(1) or 100_000_000, live=False, every=30.0)
    caplog.set_level(logging.INFO, "swarm.progress")
    assert not asked  # the input's size is asked for only once tokenizing starts
    first = shown(512, 100_000, 1_000_000, now=10.0)
    assert first.startswith("tokenizing c: 1 MB of text of 100 MB (1%), 512 documents, 0.1M tokens, 0.0 MB/s")
    line = shown(5120, 10_000_000, 25_000_000, now=60.0)  # 25 MB in the 50 s since it began: 75 MB left
    assert line == ("tokenizing c: 25 MB of text of 100 MB (25%), 5120 documents, 10.0M tokens, 0.5 MB/s, "
                    "done in 2:30")
    assert [r.getMessage() for r in caplog.records if r.name == "swarm.progress"] == [line]  # after 30 s only
    unknown = PrepareProgress("tokenizing hub", lambda: None, live=False)
    unknown(1, 10, 100, now=0.0)
    assert unknown(2, 20, 2_000_000, now=1.0).endswith("2 MB of text, 2 documents, 0.0M tokens, 2.0 MB/s, done in ?")
    assert len(asked) == 1
    shown.close()
