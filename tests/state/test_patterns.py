"""Name patterns (`taktiny.state._patterns`, behind `tt.by_name`): the glob rules against a
reference matcher built on `fnmatch`, and every error and hint word for word."""

import fnmatch

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taktiny.state import _patterns, _selection


def reference(pattern: str, name: str) -> bool:
    """The rule in docs: parts match one by one with fnmatch; `**` takes any parts."""

    def go(pats: list[str], parts: list[str]) -> bool:
        if not pats:
            return not parts
        if pats[0] == "**":
            return any(go(pats[1:], parts[k:]) for k in range(len(parts) + 1))
        return bool(parts) and fnmatch.fnmatchcase(parts[0], pats[0]) and go(pats[1:], parts[1:])

    return go(pattern.split("."), name.split("."))


def matches(pattern: str, name: str) -> bool:
    return _patterns.compile_pattern(pattern).fullmatch("." + name) is not None


CHARS = "ab_0]!\\^-"  # name characters, with the ones a set treats specially
# One token of a part: a literal, a wildcard, or a set (negated with '!', or holding ']'
# first, where it is a member): every form fnmatch reads the same way as we do.
literal = st.sampled_from("ab_0!^-+()")  # '+', '(' and ')' must be escaped in the regex
members = st.text("ab0_^\\", min_size=1, max_size=3)
a_set = st.builds(
    lambda neg, close, inside: "[" + ("!" if neg else "") + ("]" if close else "") + inside + "]",
    st.booleans(), st.booleans(), members,
)  # fmt: skip
part = st.lists(st.one_of(literal, st.just("*"), st.just("?"), a_set), min_size=1, max_size=4)
glob = part.map("".join).filter(lambda p: "**" not in p)  # "**" stands alone
pattern = st.lists(st.one_of(glob, st.just("**")), min_size=1, max_size=4)
name = st.lists(st.text(CHARS, min_size=1, max_size=4), min_size=1, max_size=4)


@given(pattern.map(".".join), name.map(".".join))
def test_patterns_match_as_fnmatch_does_part_by_part(pattern, name):
    assert matches(pattern, name) == reference(pattern, name)


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("layers.?.kernel", "layers.3.kernel", True),
        ("layers.?.kernel", "layers.12.kernel", False),  # '?' is one character
        ("a?c", "a.c", False),  # and never a dot
        ("*", "a.b", False),  # '*' stays within a part
        ("[ab]x", "bx", True),
        ("[ab]x", "cx", False),
        ("[!ab]x", "cx", True),
        ("[!ab]x", "ax", False),
        ("[]]", "]", True),  # ']' first in a set is a member
        ("[!]]", "a", True),
        ("[!]]", "]", False),
        ("*[!0]*", "0.0", False),  # a negated set never matches the dot between parts
        ("[a-c]x", "bx", True),  # ranges
        ("[a-c]x", "dx", False),
        ("[ab][cd]", "bd", True),  # two sets: the scan goes on after the first ']'
        ("[ab][cd]", "bb", False),
        ("x[ab]y*", "xayzz", True),
        ("[\\]", "\\", True),  # a backslash in a set is a member, not an escape
        ("[\\a]", "a", True),
        ("[^a]", "^", True),  # '^' in a set is a member; '!' negates
        ("[^a]", "b", False),
        ("a+b", "a+b", True),  # regex characters are literal
        ("a+b", "aab", False),
        ("**", "a.b.c", True),
        ("a.**", "a", True),  # none included
        ("**.c", "a.b.c", True),
        ("a.**.c", "a.c", True),
        ("a.**.c", "a.b.d", False),
    ],
)
def test_pattern_examples(pattern, name, expected):
    assert matches(pattern, name) is expected
    assert reference(pattern, name) is expected


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("a..b", "the pattern 'a..b' has an empty part: names have no empty parts, so it "
         "would match nothing. Remove the extra '.'."),
        (".a", "the pattern '.a' has an empty part: names have no empty parts, so it "
         "would match nothing. Remove the extra '.'."),
        ("enc**", "the pattern 'enc**' uses '**' inside the part 'enc**': '**' matches whole "
         "parts, so it must stand between dots ('encoder.**', '**.bias'); use '*' to "
         "match within a part."),
        ("a.[0", "the pattern 'a.[0' has a '[' without its ']'."),
        ("a.[]", "the pattern 'a.[]' has a '[' without its ']'."),  # ']' first is a member
        ("a.[!]", "the pattern 'a.[!]' has a '[' without its ']'."),
        ("", "a name pattern is a non-empty string, got ''."),
        (3, "a name pattern is a non-empty string, got 3."),
        (None, "a name pattern is a non-empty string, got None."),
        ("[b-a]", "the pattern '[b-a]' is not valid: bad character range b-a."),
    ],
)  # fmt: skip
def test_pattern_errors_word_for_word(pattern, message):
    with pytest.raises(ValueError) as info:
        _patterns.compile_pattern(pattern)
    assert str(info.value) == message


def test_a_pattern_is_compiled_once_and_the_store_is_bounded(monkeypatch):
    """A load's plan matches each allowed pattern against every name: each is compiled
    once (3,072 compilations made an FP8 load's plan 20 ms long), and a process making
    patterns without end keeps at most `COMPILED_BOUND` of them."""
    monkeypatch.setattr(_patterns, "_COMPILED", {})
    monkeypatch.setattr(_patterns, "COMPILED_BOUND", 3)
    parts = []
    real = _patterns.part_regex
    monkeypatch.setattr(
        _patterns, "part_regex", lambda p, part: parts.append(part) or real(p, part)
    )
    first = _patterns.compile_pattern("layers.*.kernel")
    assert _patterns.compile_pattern("layers.*.kernel") is first
    assert parts == ["layers", "*", "kernel"]  # (made once)
    assert first.fullmatch(".layers.3.kernel") and not first.fullmatch(".layers.3.bias")
    for k in range(5):
        _patterns.compile_pattern(f"p{k}")
        assert len(_patterns._COMPILED) <= 3
    with pytest.raises(ValueError, match=r"the pattern 'a\.\[' has a '\[' without its '\]'"):
        _patterns.compile_pattern("a.[")
    assert "a.[" not in _patterns._COMPILED


def test_rules_come_as_a_dict_or_a_list_of_pairs():
    assert _patterns.rule_list({"a": 1, "b.*": 2}, "f") == [("a", 1), ("b.*", 2)]
    assert _patterns.rule_list([("a", 1)], "f") == [("a", 1)]
    for entry in (["a", 1], ("a", 1, 2), "ab"):
        with pytest.raises(TypeError) as info:
            _patterns.rule_list([("b", 0), entry], "taktiny.by_name")
        assert str(info.value) == (
            "taktiny.by_name takes its rules as a dict {pattern: value} or a list of "
            f"(pattern, value) pairs, got the entry {entry!r}."
        )


def test_match_gives_the_first_rule_and_reports_what_went_unmatched_and_unused():
    names = ["a.x", "a.y", "b.x", "c"]
    rules = [("*.x", 1), ("a.*", 2), ("zz", 3), ("a.x", 4), ("q.**", 5)]
    found = _patterns.match(rules, names, default=0)
    assert found.values == [1, 2, 1, 0]
    assert found.unmatched == ["c"]
    assert found.unused == ["zz", "a.x", "q.**"]  # 'a.x' is shadowed by '*.x'
    assert found.firsts == (0, 1, 0, None)  # each name's first rule
    assert _patterns.match([], names, default=None) == ([None] * 4, names, [], (None,) * 4)


def test_a_double_star_matches_empty_parts_too():
    # a dict key may be "" (names like "scale.b." or "scale.a..x"): '**' stands for any
    # parts, empty ones included, as '*' matches an empty part
    names = ["scale.b.", "scale.a..x", "scale", "scalex.y"]
    found = _patterns.match([("scale.**", 1), ("**.x", 2)], names, default=0)
    assert found.values == [1, 1, 1, 0] and found.unmatched == ["scalex.y"]
    assert _patterns.match([("**.x", 2)], names, default=0).values == [0, 2, 0, 0]
    assert _patterns.match([("*.b.*", 1)], names, default=0).values == [1, 0, 0, 0]


@pytest.mark.parametrize(
    ("pattern", "hint"),
    [
        # a group, at any depth: it names no parameter
        ("enc", "it matches the group 'enc', not a parameter: 'enc.**' matches everything in it"),
        ("enc.inp", "it matches the group 'enc.inp', not a parameter: 'enc.inp.**' matches "
         "everything in it"),
        ("e*.in?", "it matches the group 'enc.inp', not a parameter: 'e*.in?.**' matches "
         "everything in it"),
        # the parts before the first wildcard are compared with the names and groups
        ("ecn.inp.kernal", "did you mean 'enc.inp.kernel'?"),
        ("enc.ipn.*", "did you mean 'enc.inp.*'?"),
        ("Xporj.k?", "did you mean 'Xproj.k?'?"),
        ("hd.[ab]", "did you mean 'head.[ab]'?"),
        ("enc.inp.*.w", "the names in 'enc.inp' do not match the rest, '*.w'"),
        # after a wildcard, a part that no name has is respelt as the closest one that does
        ("enc.*.kernal", "did you mean 'enc.*.kernel'?"),
        ("**.biass", "did you mean '**.bias'?"),
        ("**.Xporj.*", "did you mean '**.Xproj.*'?"),
        ("*.inp.kernal", "did you mean '*.inp.kernel'?"),
        ("*.head.bias", "no name is close to it"),  # each part is a name's: none to respell
        ("enc.*.w", "the names in 'enc' do not match the rest, '*.w'"),
        ("*.nothing", "no name is close to it"),  # nothing fixed to compare
        ("zzzzzz.*", "no name is close to it"),
        # a respelling that matches no name either is no hint ('*.Xproj.bias' names nothing)
        ("*.Xproj.bais", "no name is close to it"),
        # it matches a name, but no earlier rule is given: the rule itself came first
        ("enc.inp.kernel", "an earlier rule has the same pattern; remove one of them"),
    ],
)  # fmt: skip
def test_a_rule_that_matched_nothing_gets_a_hint(pattern, hint):
    names = ["enc.inp.kernel", "enc.inp.bias", "head.kernel", "Xproj.kernel"]
    assert _selection.unused_hint(pattern, names) == hint


def test_a_part_close_to_no_name_leaves_the_pattern_unrespelt():
    """'kernal' is close to 'kernel', but 'zzzzzz' is close to nothing: no respelling is
    offered, not even one whose missing part would read as a name's 'None'."""
    hint = _selection.unused_hint("*.zzzzzz.kernal", ["a.None.kernel"])
    assert hint == "no name is close to it"
