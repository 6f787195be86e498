"""swarm/net/ledger.py: a key weighs the recent rounds it averaged with us, at most one per round; the ledger
survives a restart, and a damaged one is refused naming its file."""

import pytest

from swarm.errors import UsageError
from swarm.net.ledger import KEPT, WINDOW, Ledger


def test_a_key_weighs_the_earlier_rounds_it_averaged_in_one_per_round():
    ledger = Ledger()
    assert ledger.weights(1) is None  # nothing known: count identities
    ledger.record(1, ["me", "p"])
    ledger.record(2, ["me", "p", "q", "q"])  # a member twice in one group is one member
    assert ledger.weights(1) is None  # round 1 itself is what is in dispute
    assert ledger.weights(2) == {"me": 1, "p": 1}
    assert ledger.weights(3) == {"me": 2, "p": 2, "q": 1}
    assert ledger.weights(3).get("stranger", 0) == 0


def test_only_the_last_window_of_rounds_weighs_and_the_file_stays_bounded(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json")
    ledger.record(1, ["me", "gone"])
    for s in range(2, WINDOW + 3):
        ledger.record(s, ["me", "p"])
    weights = ledger.weights(WINDOW + 3)
    assert weights == {"me": WINDOW, "p": WINDOW}  # "gone" left more than WINDOW rounds ago
    for s in range(WINDOW + 3, 3 * KEPT):
        ledger.record(s, ["me"])
    assert len(Ledger(tmp_path / "ledger.json").steps) == KEPT


def test_a_restarted_peer_reads_its_ledger_back_and_a_damaged_one_is_refused(tmp_path):
    path = tmp_path / "ledger.json"
    Ledger(path).record(5, ["me", "p"])
    assert Ledger(path).weights(6) == {"me": 1, "p": 1}
    for damaged in ("{not json", '{"version": 2, "steps": {}}', '{"version": 1, "steps": {"x": ["p"]}}',
                    '{"version": 1, "steps": {"3": [1, 2]}}', "[]"):
        path.write_text(damaged)
        with pytest.raises(UsageError, match="ledger.json"):
            Ledger(path)
