"""Counted repetitions too long for llguidance: a regex, a JSON schema's pattern or a Lark grammar that requires more
than MAX_FIXED_CHARS characters (or Lark items) from one repetition is refused at submission.

Why: llguidance compiles such a grammar and forces its first bytes, but walking a long forced run exhausts its lexer
("too many expressions constructed") or parser ("Too many items ... ff_tokens") once a sequence reaches it, so the
request failed mid-answer with a 500 (`a{1000000}`, `(x|y)a{100000}`, `(a{100}b){1000}`, Lark's `"a"{200000}`). Shorter
repetitions still cost milliseconds a step while they are forced; no answer of this length fits a context anyway.
Only the lower bound counts: `[a-z]{0,1000000}` forces nothing and is served. A literal longer than that (a JSON
schema's const or enum value, a choice, a Lark string) fails the same way and is refused too (`literal_error`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

try:
    import re._parser as sre  # type: ignore[import-not-found]  # Python 3.11+
except ImportError:  # pragma: no cover - older Pythons
    import sre_parse as sre  # type: ignore[no-redef]

MAX_FIXED_CHARS = 10_000  # the most characters one counted repetition (or one literal) may require
_REPEATS = frozenset(op for op in (getattr(sre, "MAX_REPEAT", None), getattr(sre, "MIN_REPEAT", None),
                                   getattr(sre, "POSSESSIVE_REPEAT", None)) if op is not None)
_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*\d*\s*)?\}")  # {m}, {m,}, {m,n}: m is the lower bound
_LARK_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*\d*\s*)?\}|~\s*(\d+)")  # Lark's item{m,n} and item~m / item~m..n


def _subpatterns(av: Any) -> Iterator[Any]:
    if isinstance(av, sre.SubPattern):
        yield av
    elif isinstance(av, list | tuple):
        for item in av:
            yield from _subpatterns(item)


def _repeats(pattern: Any) -> Iterator[tuple[int, Any]]:
    """(lower bound, repeated subpattern) of each counted repetition in a parsed regex, at any depth."""
    for op, av in pattern:
        if op in _REPEATS:
            yield av[0], av[2]
        for sub in _subpatterns(av):
            yield from _repeats(sub)


def regex_repeat_error(regex: str) -> str | None:
    """Why a regex's counted repetition is too long for llguidance, or None. Python's parser reads the regex (Rust's
    and ECMAScript's syntax are close enough for counts); one it cannot parse is checked by its counts' text."""
    try:
        pattern = sre.parse(regex)
    except (re.error, OverflowError, RecursionError):
        counts = (int(m.group(1)) for m in _COUNT.finditer(regex))
        worst = max(counts, default=0)
        return _too_long(f"{{{worst}}}", worst) if worst > MAX_FIXED_CHARS else None
    for lower, sub in _repeats(pattern):
        num_chars = lower * sub.getwidth()[0]
        if num_chars > MAX_FIXED_CHARS:
            return _too_long(f"{{{lower}}}", num_chars)
    return None


def _too_long(what: str, num_chars: int) -> str:
    return (f"a counted repetition ({what}) requires {num_chars} characters; at most {MAX_FIXED_CHARS} are "
            "supported")


def lark_repeat_error(grammar: str) -> str | None:
    """regex_repeat_error for each /regex/ of a Lark grammar, literal_error for each string, and its own repetitions
    (`item{m,n}`, `item~m`) of more than MAX_FIXED_CHARS items; comments are skipped."""
    i, num_chars = 0, len(grammar)
    plain: list[str] = []  # the grammar outside literals, regexes and comments
    while i < num_chars:
        char = grammar[i]
        if char == '"':
            end = _literal_end(grammar, i, '"')
            if (why := literal_error(grammar[i + 1:end - 1])) is not None:
                return why
            i = end
        elif grammar.startswith("//", i) or char == "#":
            i = grammar.find("\n", i) if "\n" in grammar[i:] else num_chars
        elif char == "/":
            end = _literal_end(grammar, i, "/")
            if (why := regex_repeat_error(grammar[i + 1:end - 1])) is not None:
                return why
            i = end
        else:
            plain.append(char)
            i += 1
    for match in _LARK_COUNT.finditer("".join(plain)):
        lower = int(match.group(1) or match.group(2))
        if lower > MAX_FIXED_CHARS:
            return (f"a counted repetition ({match.group(0)}) requires {lower} items; at most {MAX_FIXED_CHARS} are "
                    "supported")
    return None


def _literal_end(text: str, start: int, quote: str) -> int:
    """The index past a literal opened by `quote` at `start` (backslash escapes skipped), or the text's end."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == quote:
            return i + 1
        else:
            i += 1
    return len(text)


def literal_error(text: str) -> str | None:
    """Why a literal (as written: escapes count) is too long for llguidance to force, or None."""
    if len(text) > MAX_FIXED_CHARS:
        return f"a literal of {len(text)} characters is too long; at most {MAX_FIXED_CHARS} are supported"
    return None
