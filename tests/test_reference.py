"""docs/reference.md is the parser's `--help` of every command and the hook's declared settings,
word for word: one source of truth for each (`python3 -m dev reference` rewrites it)."""

from __future__ import annotations

import re

from dev import reference
from rankfs.loader import settings


def test_the_reference_is_what_the_parser_and_the_settings_say():
    assert reference.PATH.read_text() == reference.render(), "run: python3 -m dev reference"


def test_every_variable_the_hook_reads_is_declared():
    """The settings module reads no variable it does not declare (and so document)."""
    read = set(re.findall(r'"(RANKFS_[A-Z_]+)"', (reference.ROOT / "loader" / "settings.py").read_text()))
    assert read == {s.variable for s in settings.SETTINGS}
