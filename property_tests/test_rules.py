"""Invariant 12: a conversion rule whose source and target each have one ``**`` part
renames names of any depth, and exports them back.

The templates are a source prefix, ``**`` and a suffix (``model.**.weight``) and a target
prefix, ``**`` and a suffix (``**.kernel``), each prefix and suffix of zero to two parts;
the names are the source's prefix and suffix around middles of zero to three parts, beside
names of any parts. The oracle is written from the documented rule alone: a name matches
when its parts are the prefix, any parts, then the suffix (`rules.pattern_matches`), and
its target is the target's prefix, the same middle parts and the target's suffix.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from taktiny import convert

from .budget import examples
from .rules import pattern_matches

PARTS = st.sampled_from(("a", "b", "0", "1", "model", "weight", "kernel"))
AFFIX = st.lists(PARTS, max_size=2)


@settings(max_examples=examples(100))
@given(data=st.data())
def test_a_double_star_carries_the_parts_it_matched_to_the_target_and_back(data):
    """Each name the source template matches (by the oracle) goes to the oracle's target
    name with its own array, every other name is left unused, and export gives back the
    matched names with their arrays; the rule can export.

    Seen to catch (each by hand): a ``**`` that must match one part or more, a target whose
    ``**`` leaves its dot behind when it stands for no part, and an export that fills the
    source's ``**`` with nothing."""
    source_prefix, source_suffix = data.draw(AFFIX), data.draw(AFFIX)
    target_prefix, target_suffix = data.draw(AFFIX), data.draw(AFFIX)
    rule = convert.Rule(
        ".".join([*source_prefix, "**", *source_suffix]),
        ".".join([*target_prefix, "**", *target_suffix]),
    )
    assert rule.irreversible() is None
    middles = data.draw(st.lists(st.lists(PARTS, max_size=3), max_size=5, unique_by=tuple))
    others = data.draw(st.lists(st.lists(PARTS, min_size=1, max_size=5), max_size=4))
    names = {".".join([*source_prefix, *m, *source_suffix]) for m in middles}
    names |= {".".join(parts) for parts in others}
    names.discard("")  # (no name is empty)
    source = {name: np.full(1, i, np.float32) for i, name in enumerate(sorted(names))}
    expected: dict[str, str] = {}  # target name -> source name, by the oracle
    for name in source:
        parts = name.split(".")
        if not pattern_matches(rule.sources[0], name):
            continue
        middle = parts[len(source_prefix) : len(parts) - len(source_suffix)]
        expected[".".join([*target_prefix, *middle, *target_suffix])] = name
    if "" in expected:
        return  # (a middle of no parts between empty target affixes names nothing)
    target = {t: np.zeros(1, np.float32) for t in expected}
    unused = [n for n in source if n not in expected.values()]  # (reported, and let through)
    allow = {"unused": unused, "unmatched": list(rule.sources)}
    report = convert.check([rule], source, target=target, allow=allow)
    assert sorted(p.name for p in report.allowed if p.kind == "unused") == sorted(unused)
    converted = convert.convert([rule], source, target=target, allow=allow)
    assert sorted(converted) == sorted(expected)
    for made, name in expected.items():
        assert np.array_equal(converted[made], source[name]), (made, name)
    exported = convert.export([rule], converted)
    assert sorted(exported) == sorted(expected.values())
    for name, value in exported.items():
        assert np.array_equal(value, source[name]), name
