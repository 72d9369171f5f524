"""The hardened YAML loader shared by `launch --config` and the placement file.

Each refusal (an alias, deep nesting, a key given twice) and each value no constructor can make
is one StrictYAMLError naming the file and the line, never a traceback; a message quoting a
value quotes it briefly.
"""

from __future__ import annotations

import pytest

from omni_dp.yamlconfig import StrictYAMLError, brief, clip, load_strict

# 9 levels of 9 aliases: ~300 bytes that safe_load expands to 9**9 strings.
LAUGHS = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))


def refusal(text: str, **kwargs) -> StrictYAMLError:
    with pytest.raises(StrictYAMLError) as caught:
        load_strict(text, "f.yaml", **kwargs)
    return caught.value


def test_a_plain_document_loads_as_safe_load_would():
    assert load_strict("a: 1\nb: [x, {c: null}]\n", "f.yaml") == {"a": 1, "b": ["x", {"c": None}]}
    assert load_strict("", "f.yaml") is None
    assert load_strict("<<: {a: 1}\na: 2\n", "f.yaml") == {"a": 2}  # a merge key: no duplicate


def test_an_alias_bomb_is_refused_at_its_first_alias():
    assert len(LAUGHS) < 350
    error = refusal(LAUGHS, what="a placement file")
    assert str(error) == ("f.yaml, line 2: aliases (*name) are not supported in a placement "
                          "file; write the value out")
    assert (error.source, error.line) == ("f.yaml", 2)
    assert isinstance(error, ValueError)


@pytest.mark.parametrize("text", [
    "a: " + "[" * 20_000 + "]" * 20_000 + "\n",
    "a: " + "{b: " * 20_000 + "1" + "}" * 20_000 + "\n",
    "".join(" " * i + "k:\n" for i in range(20_000)),
])
def test_nesting_without_bound_is_refused_not_a_recursion_error(text):
    assert str(refusal(text, shape="say it flatter")).endswith(
        ": nested deeper than 8 levels; say it flatter")


@pytest.mark.parametrize(("text", "message"), [
    ("a: 1\nb: 2\na: 3\n", "f.yaml, line 3: duplicate key 'a' (first on line 1); keep one"),
    ("{a: 1, a: 2}\n", "f.yaml, line 1: duplicate key 'a' (first on line 1); keep one"),
    ("a:\n  b: 1\n  b: 2\n", "f.yaml, line 3: duplicate key 'b' (first on line 2); keep one"),
    ("1: x\n1.0: y\n", "f.yaml, line 2: duplicate key 1.0 (first on line 1); keep one"),
])
def test_a_duplicate_key_is_refused_naming_it_and_both_lines(text, message):
    assert str(refusal(text)) == message


@pytest.mark.parametrize(("text", "line", "needle"), [
    ("a: 1\nb: 2024-02-30\n", 2, "cannot read this value (day is out of range for month)"),
    ("a: " + "9" * 5000 + "\n", 1, "cannot read this value (Exceeds the limit"),
    ("a: !!int abc\n", 1, "cannot read this value (invalid literal"),
    ("a: 1\nb: !!timestamp x\n", 2, "cannot read this value ('x' is no !!timestamp)"),  # was an
    ("a: !!float ''\n", 1, "cannot read this value ('' is no !!float)"),  # AttributeError, an
    ("a: [!!int '']\n", 1, "cannot read this value ('' is no !!int)"),  # IndexError
    ("a: 1\nb: [1\n", 3, "not valid YAML ("),
    ("a: 1\nb: \x01\n", 2, "not valid YAML (unacceptable character #x0001"),
    ("a: !!python/name:os.system\n", 1, "not valid YAML (could not determine a constructor"),
    ("a: 1\n---\nb: 2\n", 2, "not valid YAML (but found another document)"),
    ("? [a]\n: 1\n", 1, "not valid YAML (found unhashable key)"),
])
def test_every_failure_is_one_error_with_its_line(text, line, needle):
    error = refusal(text)
    assert error.line == line and needle in error.problem
    assert len(str(error)) < 200


def test_brief_quotes_any_value_in_at_most_sixty_characters():
    assert brief("talker") == "'talker'" and brief(10**23) == "100000000000000000000000"
    assert brief(16**5000) == "<an integer of 20001 bits>"  # repr() would raise
    assert brief({"a": [16**5000]}) == "{'a': [<an integer of 20001 bits>]}"
    for value in ("x" * 1_000_000, list(range(100_000)), {str(i): i for i in range(1000)},
                  [[[[["deep"]]]]], b"\0" * 10_000):
        assert len(brief(value)) <= 60
    assert clip("y" * 100) == "y" * 57 + "..." and clip("short") == "short"
