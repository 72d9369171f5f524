"""Hardened YAML for the configuration files omni-dp reads (`launch --config`, a placement file).

`yaml.safe_load` constructs no Python objects, but it still accepts what a settings file never
needs and a hostile one uses: aliases (`*name`: a billion-laughs document of a few hundred bytes
expands exponentially), nesting without bound (PyYAML's composer recurses per level, so a deep
document ends in a RecursionError), and a mapping key given twice (the last one wins silently).
StrictLoader refuses all three; load_strict reads a document with it and turns every failure,
a constructor's ValueError included, into one StrictYAMLError naming the file and the line.
"""

from __future__ import annotations

import reprlib

import yaml
import yaml.reader

# The deepest a configuration nests: a top mapping, a mapping per section, a list, a list in
# it, the value; more is a mistake or an attack, refused before the composer recurses into it.
MAX_DEPTH = 8
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Brief(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:  # repr refuses more than 4300 digits, and 39 are plenty
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_BRIEF = _Brief()
_BRIEF.maxstring = _BRIEF.maxother = _BRIEF.maxlong = 40
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxset = _BRIEF.maxdict = 4
_BRIEF.maxlevel = 2


def clip(text: str, limit: int = 60) -> str:
    """`text` cut to at most `limit` characters, "..." marking the cut."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def brief(value: object, limit: int = 60) -> str:
    """repr(value) for a message: at most `limit` characters, whatever the value (a 1 MiB
    string, a list of 100,000 items, an integer too long for repr)."""
    return clip(_BRIEF.repr(value), limit)


class Refused(yaml.MarkedYAMLError):
    """Valid YAML that a configuration file may not hold (an alias, deep nesting, a key given
    twice); `problem` says which and how to write it instead, `problem_mark` where."""


class StrictLoader(yaml.SafeLoader):
    """safe_load, refusing aliases, nesting deeper than `max_depth` and duplicate mapping keys.

    `what` names the file in the alias refusal ("a --config file"), `shape` says in the nesting
    refusal what the file holds instead. Duplicate keys are refused where a mapping is
    constructed, so a caller that reads a mapping's nodes itself (the launcher reads its top
    mapping key by key) reports those its own way."""

    def __init__(self, stream: str, *, what: str = "a configuration file",
                 shape: str = "a configuration nests no deeper",
                 max_depth: int = MAX_DEPTH) -> None:
        super().__init__(stream)
        self._what, self._shape, self._max_depth = what, shape, max_depth
        self._depth = 0
        self.last_node: yaml.Node | None = None  # the node constructed last (for a ValueError)

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise Refused(None, None, f"aliases (*name) are not supported in {self._what}; "
                          "write the value out", self.peek_event().start_mark)
        self._depth += 1
        try:
            if self._depth > self._max_depth:
                raise Refused(None, None, f"nested deeper than {self._max_depth} levels; "
                              f"{self._shape}", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node, deep=False):
        self.last_node = node
        try:
            return super().construct_object(node, deep)
        except (yaml.YAMLError, ValueError, OverflowError):
            raise
        except Exception:  # a constructor's own failure on odd input: `!!timestamp x`
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise ValueError(f"{brief(node.value)} is no {clip(tag)}") from None

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[object, int] = {}  # key -> the line it is first on
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:  # `<<`: explicit keys override merged ones
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable: the constructor below says so
                    continue
                if first is not None:
                    raise Refused("while constructing a mapping", node.start_mark,
                                  f"duplicate key {brief(key)} (first on line {first}); keep "
                                  "one", key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


class StrictYAMLError(ValueError):
    """A document load_strict refused: `source` (the file as the user named it), `line` (from 1;
    None where unknown) and `problem` (one line), together as the message."""

    def __init__(self, source: str, line: int | None, problem: str) -> None:
        where = f"{source}, line {line}" if line is not None else source
        super().__init__(f"{where}: {problem}")
        self.source, self.line, self.problem = source, line, problem


def _line_of(text: str, position: int) -> int:
    return text.count("\n", 0, max(position, 0)) + 1


def load_strict(text: str, source: str, *, what: str = "a configuration file",
                shape: str = "a configuration nests no deeper",
                max_depth: int = MAX_DEPTH) -> object:
    """The one document of `text` (None when empty), read by StrictLoader. Raises
    StrictYAMLError, never anything else: not valid YAML, a refusal, or a value no constructor
    can make (`2024-02-30`, an integer of 5,000 digits)."""
    loader = None
    try:
        loader = StrictLoader(text, what=what, shape=shape, max_depth=max_depth)  # the reader
        return loader.get_single_data()  # refuses a control character at once
    except Refused as exc:
        raise StrictYAMLError(source, _mark_line(exc), exc.problem or "refused") from None
    except yaml.MarkedYAMLError as exc:
        what_is_wrong = exc.problem or exc.context or "a syntax error"
        raise StrictYAMLError(source, _mark_line(exc),
                              f"not valid YAML ({what_is_wrong})") from None
    except yaml.reader.ReaderError as exc:  # a control character: the reader's own message
        raise StrictYAMLError(source, _line_of(text, exc.position),
                              f"not valid YAML ({str(exc).splitlines()[0]})") from None
    except yaml.YAMLError as exc:
        raise StrictYAMLError(source, None, f"not valid YAML ({str(exc).splitlines()[0]})"
                              ) from None
    except (ValueError, OverflowError) as exc:  # a constructor's: datetime, int(), ...
        node = loader.last_node if loader is not None else None
        line = node.start_mark.line + 1 if node is not None else None
        reason = clip((str(exc).splitlines() or [type(exc).__name__])[0].split(";")[0], 80)
        raise StrictYAMLError(source, line, f"cannot read this value ({reason})") from None
    finally:
        if loader is not None:
            loader.dispose()


def _mark_line(exc: yaml.MarkedYAMLError) -> int | None:
    mark = exc.problem_mark or exc.context_mark
    return mark.line + 1 if mark is not None else None
