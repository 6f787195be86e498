"""swarm/net/ledger.py: a key that took part in one of our recent rounds has one vote, a stranger none; the
ledger survives a restart, and a damaged one is refused naming its file."""

import pytest

from swarm.errors import UsageError
from swarm.net.ledger import KEPT, WINDOW, Ledger


def test_a_key_that_took_part_in_an_earlier_round_has_one_vote():
    ledger = Ledger()
    assert ledger.known(1) is None  # nothing known: count identities
    ledger.record(1, ["me", "p"])
    ledger.record(2, ["me", "p", "q", "q"])  # a member twice in one group is one member
    ledger.record(2, ["me", "q"])  # the holders of a state taken for round 2: added, once each
    assert ledger.known(1) is None  # round 1 itself is what is in dispute
    assert ledger.known(2) == {"me", "p"}
    assert ledger.known(3) == {"me", "p", "q"}  # one vote, however many rounds
    assert "stranger" not in ledger.known(3)


def test_only_the_last_window_of_rounds_weighs_and_the_file_stays_bounded(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json")
    ledger.record(1, ["me", "gone"])
    for s in range(2, WINDOW + 3):
        ledger.record(s, ["me", "p"])
    assert ledger.known(WINDOW + 3) == {"me", "p"}  # "gone" left more than WINDOW rounds ago
    for s in range(WINDOW + 3, 3 * KEPT):
        ledger.record(s, ["me"])
    assert len(Ledger(tmp_path / "ledger.json").steps) == KEPT


def test_a_restarted_peer_reads_its_ledger_back_and_a_damaged_one_is_refused(tmp_path):
    path = tmp_path / "ledger.json"
    Ledger(path).record(5, ["me", "p"])
    assert Ledger(path).known(6) == {"me", "p"}
    for damaged in ("{not json", '{"version": 2, "steps": {}}', '{"version": 1, "steps": {"x": ["p"]}}',
                    '{"version": 1, "steps": {"3": [1, 2]}}', "[]"):
        path.write_text(damaged)
        with pytest.raises(UsageError, match="ledger.json"):
            Ledger(path)
