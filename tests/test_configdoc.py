"""docs/config.md is the generated reference of every config key, current and complete."""

import dataclasses

from swarm import config
from swarm.run.configdoc import keys, reference
from tests.conftest import ROOT


def test_every_key_of_every_section_is_documented_with_a_meaning():
    documented = {k.dotted for k in keys()}
    declared = {f"{s.name}.{f.name}" for s in dataclasses.fields(config.Config)
                for f in dataclasses.fields(s.default_factory)}
    assert documented == declared
    assert [k.dotted for k in keys() if not k.meaning] == []


def test_docs_config_md_is_current():
    """Regenerate it with `python -m swarm.run.configdoc > docs/config.md` after changing swarm/config.py."""
    assert (ROOT / "docs" / "config.md").read_text() == reference()
