"""bench/data.py's generated corpus: the size asked for, one document per line, prepared as the bench reads it."""

from bench import data as bench_data
from swarm.data.batches import load_corpus
from swarm.run.configfile import load_config


def test_a_generated_corpus_has_the_size_asked_for_and_prepares(tmp_path):
    bench_data.generate(tmp_path / "corpus", 2)
    lines = (tmp_path / "corpus" / "part.txt").read_text().splitlines()
    assert 2_000_000 <= sum(len(line) + 1 for line in lines) < 2_100_000 and len(set(lines)) > 100
    cfg = load_config(None, {"data": {"source": "hf", "dataset": str(tmp_path / "corpus"),
                                      "cache_dir": str(tmp_path / "cache")}}).data
    corpus = load_corpus(cfg, cache=False)
    assert len(corpus.train) + len(corpus.eval) == sum(len(line) + 1 for line in lines)
