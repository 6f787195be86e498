"""swarm/net/ledger.py: a key that took part in one of our recent rounds has one vote, a stranger none; the
ledger survives a restart, and a damaged one is refused naming its file."""

import pytest

from swarm.errors import UsageError
from swarm.net.ledger import KEPT, MAX_MEMBERS, WINDOW, Ledger
from swarm.net.schema import Statement


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
    for damaged in ("{not json", '{"version": 3, "steps": {}}', '{"version": 2, "steps": {}, "statements": [{}]}', '{"version": 1, "steps": {"x": ["p"]}}',
                    '{"version": 1, "steps": {"3": [1, 2]}}', "[]"):
        path.write_text(damaged)
        with pytest.raises(UsageError, match="ledger.json"):
            Ledger(path)


def test_the_lineage_statements_and_founders_survive_a_restart_and_a_version_1_file_still_reads(tmp_path):
    """What certificates are grounded on and what this peer signed (certificates.py) outlive a restart; a
    state taken at an earlier outer step drops what followed it."""
    path = tmp_path / "ledger.json"
    ledger = Ledger(path)
    ledger.found(iter(["me", "p"]))
    statement = Statement(round=1, parent="0" * 64, sha256="1" * 64, group="ab", size=2)
    ledger.hold(0, "0" * 64)
    ledger.hold(1, "1" * 64, statement)
    ledger.hold(1, "1" * 64)  # the same state offered again
    ledger.found(["late"])  # founders are those of outer step 0 only
    ledger.hold(2, "2" * 64)
    again = Ledger(path)
    assert (again.lineage, again.statements, again.founders) == ({0: "0" * 64, 1: "1" * 64, 2: "2" * 64},
                                                                 (statement,), {"me", "p"})
    again.hold(1, "9" * 64)  # took another state of outer step 1
    assert again.lineage == {0: "0" * 64, 1: "9" * 64} and again.statements == ()
    path.write_text('{"version": 1, "steps": {"3": ["p"]}}')
    assert Ledger(path).known(4) == {"p"} and Ledger(path).lineage == {}


def test_remembered_credit_moves_only_forward_survives_a_restart_and_stays_bounded(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json")
    ledger.remember({"q": 12, "r": 12})
    ledger.remember({"q": 9, "s": 3})  # an older reading never takes credit back
    assert Ledger(tmp_path / "ledger.json").credit == {"q": 12, "r": 12, "s": 3}
    ledger.remember({f"k{i}": 20 for i in range(MAX_MEMBERS + 10)})
    assert len(ledger.credit) == MAX_MEMBERS and "q" not in ledger.credit  # the least recent go first
