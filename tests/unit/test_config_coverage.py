"""Every config key printed by ``megarl config --describe`` is exercised by some test.

A key ``section.field`` counts as exercised by a test file (other than this one) that holds

(a) the dotted name ``section.field`` (an override such as ``algorithm.clip_high=0.3``, an error
    message, or ``cfg.section.field``), or
(b) a recipe line ``field:`` inside a block under a ``section:`` line, or
(c) a recipe line ``field:`` (also at the start of a string: ``"  field: value"``) anywhere, when
    no other section has a field of that name (the algorithm-section bodies of
    tests/e2e/test_algorithms_e2e.py have no section line).

This is a reference check: that the referencing test shows the key changing behaviour, or
failing with an error that names it at load time, is up to that test (see
tests/unit/test_config.py and tests/unit/test_config_effects.py). A new key without a test fails
here.
"""
import dataclasses
import re
import typing
from collections import Counter
from pathlib import Path

from megarl.config.schema import SECTIONS, MegaRLConfig

TESTS = Path(__file__).resolve().parents[1]


def schema_keys() -> list[tuple[str, str]]:
    hints = typing.get_type_hints(MegaRLConfig)
    return [(section.name, f.name) for section in dataclasses.fields(MegaRLConfig)
            for f in dataclasses.fields(hints[section.name])]


def recipe_keys(text: str) -> tuple[set[tuple[str, str]], set[str]]:
    """(section, field) pairs of recipe blocks in ``text``, and every ``field:`` line's field."""
    # a key at the start of a line, or of a string ('"""  name: dapo', "  tp: 2")
    line_re = re.compile(r"^(?P<indent>[ \t]*)(?:\(?[\"']{1,3})?[ \t]*(?P<key>\w+):(?:[ \t]|$)")
    in_blocks = set()
    anywhere = set(re.findall(r"[\"'][ \t]+(\w+):[ \t]", text))
    section, section_indent = None, -1
    for line in text.splitlines():
        match = line_re.match(line)
        if not match:
            continue
        indent, key = len(match["indent"]), match["key"]
        anywhere.add(key)
        if key in SECTIONS and line.rstrip().endswith(":"):
            section, section_indent = key, indent
        elif section is not None and indent > section_indent:
            in_blocks.add((section, key))
        else:
            section = None
    return in_blocks, anywhere


def test_every_config_key_is_exercised_by_a_test():
    keys = schema_keys()
    field_count = Counter(name for _, name in keys)
    files = [p for p in TESTS.rglob("*.py") if p.resolve() != Path(__file__).resolve()]
    dotted, in_blocks, anywhere = set(), set(), set()
    for path in files:
        text = path.read_text()
        dotted.update(re.findall(r"\b(" + "|".join(SECTIONS) + r")\.(\w+)", text))
        blocks, loose = recipe_keys(text)
        in_blocks |= blocks
        anywhere |= loose
    missing = [f"{s}.{k}" for s, k in keys
               if (s, k) not in dotted and (s, k) not in in_blocks
               and not (field_count[k] == 1 and k in anywhere)]
    assert not missing, f"config keys no test exercises (add a test, see this file's docstring): {missing}"


def test_the_scan_reads_recipe_blocks():
    text = 'RECIPE = """\nrollout:\n  tp: 2\n  n: 4\ntrainer:\n  seed: 1\n"""\nOTHER = ("""  clip_low: 0.1"""'
    blocks, anywhere = recipe_keys(text)
    assert blocks == {("rollout", "tp"), ("rollout", "n"), ("trainer", "seed")}
    assert {"clip_low", "tp", "seed"} <= anywhere
    assert ("topology", "tp") not in blocks
