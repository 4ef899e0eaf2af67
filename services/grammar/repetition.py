"""Forced runs too long for llguidance: a regex, a JSON schema or a Lark grammar whose text, once the model has made
a choice, is forced for longer than llguidance can walk is refused at submission (a 400).

Why: llguidance compiles such a grammar, but walking a long forced run exhausts its lexer ("too many expressions
constructed") or its parser ("Too many items (limit 50000; ff_tokens)") once a sequence reaches it, so the request
failed mid-answer with a 500. Only forced text counts: a literal and counted repetitions of literals (multiplied
through groups and Lark rules); a class, `.` or an alternation is the model's choice and forces nothing
(`[a-z]{20000}` is served). A run at the very start is walked once at submission (compiler.GrammarChecker), which
refuses whatever fails there, so these limits are for runs after a choice. Measured with llguidance 1.9.1 and
SmolLM2's tokenizer (a run after `(x|y)`): a regex lexeme fails past ~50,000 forced characters (45,000 work,
60,000 fail); the parser past ~30,000 forced Lark lexemes ("a"{30000} works, {33000} fails) and past ~10,000 items
of a JSON array whose item is fixed (10,000 work, 13,000 fail); a JSON string with a pattern of one repeated literal
past ~3,500 characters of minLength (3,500 work, 4,000 fail); a literal past ~60,000 bytes (60,000 work, 200,000 fail).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

try:
    import re._constants as sre_c  # type: ignore[import-not-found]  # Python 3.11+
    import re._parser as sre  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - older Pythons
    import sre_constants as sre_c  # type: ignore[no-redef]
    import sre_parse as sre  # type: ignore[no-redef]

MAX_FORCED_CHARS = 40_000  # forced characters in one regex lexeme after a choice (fails at ~50,000)
MAX_FORCED_LEXEMES = 30_000  # forced Lark lexemes in one run after a choice (fails at ~31,000)
MAX_FIXED_ITEMS = 10_000  # minItems of a JSON array whose item is fixed (fails at ~12,000)
MAX_FIXED_PATTERN_LEN = 3_000  # minLength of a JSON string whose pattern repeats one literal (fails at ~4,000)
_REPEATS = frozenset(op for op in (getattr(sre_c, "MAX_REPEAT", None), getattr(sre_c, "MIN_REPEAT", None),
                                   getattr(sre_c, "POSSESSIVE_REPEAT", None)) if op is not None)
_NEUTRAL = frozenset(op for op in (getattr(sre_c, "AT", None),) if op is not None)  # anchors match no text
_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*\d*\s*)?\}")  # {m}, {m,}, {m,n}: m is the lower bound


@dataclass(frozen=True, slots=True)
class Run:
    """The forced runs of a piece of grammar, in characters (a regex) or lexemes (Lark): the run it starts with, the
    longest run wholly inside it, the run it ends with, and whether all of it is forced (then prefix is its length)."""

    prefix: int
    inner: int
    suffix: int
    forced: bool


FORCED_NOTHING = Run(0, 0, 0, False)


def forced(length: int) -> Run:
    return Run(length, 0, length, True)


def sequence(runs: Iterator[Run] | list[Run]) -> Run:
    """The runs of pieces one after another: a forced piece extends the open run, a choice closes it."""
    prefix, inner, open_run, all_forced = 0, 0, 0, True
    for run in runs:
        if run.forced:
            prefix += run.prefix if all_forced else 0
            open_run += run.prefix
        elif all_forced:
            prefix, inner, open_run, all_forced = prefix + run.prefix, max(inner, run.inner), run.suffix, False
        else:
            inner, open_run = max(inner, open_run + run.prefix, run.inner), run.suffix
    return forced(prefix) if all_forced else Run(prefix, inner, open_run, False)


def repeat(run: Run, lower: int, exact: bool) -> Run:
    """A piece repeated at least `lower` times (exactly, when `exact`): only the lower bound is forced."""
    if lower == 0:
        return Run(0, run.inner, 0, False)
    if run.forced:
        return forced(lower * run.prefix) if exact else Run(lower * run.prefix, 0, 0, False)
    joined = run.suffix + run.prefix if lower >= 2 else 0  # one iteration's end runs into the next one's start
    return Run(run.prefix, max(run.inner, joined), run.suffix if exact else 0, False)


def longest_after_start(run: Run) -> int:
    """The longest run that does not start the text (the start is walked at submission)."""
    return 0 if run.forced else max(run.inner, run.suffix)


def _regex_run(pattern: Any) -> Run:
    return sequence(_item_run(op, av) for op, av in pattern)


def _item_run(op: Any, av: Any) -> Run:
    if op == sre_c.LITERAL:
        return forced(len(chr(av).encode()))  # llguidance walks bytes
    if op in _NEUTRAL:
        return forced(0)
    if op == sre_c.SUBPATTERN:
        return _regex_run(av[-1])
    if op in _REPEATS:
        return repeat(_regex_run(av[2]), av[0], av[0] == av[1])
    if op == sre_c.BRANCH:
        return Run(0, max((longest_after_start(_regex_run(b)) for b in av[1]), default=0), 0, False)
    return FORCED_NOTHING  # a class, `.`, a category: the model's choice


def regex_run(regex: str) -> Run | None:
    """The forced runs of a regex, in bytes; None if Python's parser cannot read it (Rust's and ECMAScript's syntax
    are close enough for the rest)."""
    try:
        return _regex_run(sre.parse(regex))
    except (re.error, OverflowError, RecursionError, ValueError):
        return None


def regex_repeat_error(regex: str, at_start: bool = False) -> str | None:
    """Why a regex forces more than llguidance can walk after a choice, or None. `at_start`: the regex is the whole
    grammar, whose forced start is walked at submission instead. One Python cannot parse is judged by its counts."""
    run = regex_run(regex)
    if run is None:
        worst = max((int(m.group(1)) for m in _COUNT.finditer(regex)), default=0)
        return _too_long(worst) if worst > MAX_FORCED_CHARS else None
    num_chars = longest_after_start(run) if at_start else max(run.prefix, run.inner, run.suffix)
    return _too_long(num_chars) if num_chars > MAX_FORCED_CHARS else None


def _too_long(num_chars: int) -> str:
    return (f"a regex forces a run of {num_chars} characters after a choice; at most {MAX_FORCED_CHARS} are "
            "supported")


def literal_error(text: str) -> str | None:
    """Why a literal (decoded text) is too long for llguidance to force after a choice, or None."""
    num_chars = len(text.encode())
    if num_chars > MAX_FORCED_CHARS:
        return f"a literal of {num_chars} bytes is too long; at most {MAX_FORCED_CHARS} are supported"
    return None


def fixed_json_error(schema: dict[str, Any]) -> str | None:
    """Why a JSON schema's array of a fixed item, or string whose pattern repeats one literal, forces more than
    llguidance's parser or lexer can walk, or None."""
    min_items, items = schema.get("minItems"), schema.get("items")
    if isinstance(min_items, int) and min_items > MAX_FIXED_ITEMS and isinstance(items, dict) and _is_fixed(items):
        return (f"minItems ({min_items}) of a fixed item forces more than llguidance can walk; at most "
                f"{MAX_FIXED_ITEMS} are supported")
    min_len, pattern = schema.get("minLength"), schema.get("pattern")
    if isinstance(min_len, int) and min_len > MAX_FIXED_PATTERN_LEN and isinstance(pattern, str):
        if _repeats_forced_text(pattern.removeprefix("^").removesuffix("$")):  # `a*`, `(ab)+`: llguidance builds
            return (f"minLength ({min_len}) with a pattern that forces its text is more than llguidance can walk; at "
                    f"most {MAX_FIXED_PATTERN_LEN} are supported")
    return None


def _is_fixed(item: dict[str, Any]) -> bool:
    enum = item.get("enum")
    return "const" in item or (isinstance(enum, list) and len(enum) == 1)


_LARK_TOKEN = re.compile(r"""
    (?P<string>"(?:\\.|[^"\\])*"i?) | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*) | (?P<comment>(?://|\#)[^\n]*)
  | (?P<json>%json\s*) | (?P<special><\|[^|]*\|>|<\[[^\]]*\]>)
  | (?P<count>\{\s*(?P<lo>\d+)\s*(?P<hi>,\s*\d*\s*)?\}|~\s*(?P<tlo>\d+)(?P<thi>\s*\.\.\s*\d+)?)
  | (?P<rule>^[?!]?(?P<name>[\w]+)(?:\.-?\d+)?\s*:) | (?P<ref>[\w]+) | (?P<op>[()\[\]|?*+]) | (?P<nl>\n)
  | \s+ | (?P<other>.)
""", re.VERBOSE | re.MULTILINE)


def lark_repeat_error(grammar: str) -> str | None:
    """Why a Lark grammar forces more lexemes than llguidance's parser can walk after a choice (counts multiplied
    through groups and rules), or one of its regexes or literals more characters than its lexer can, or None.
    `%json {...}` bodies are skipped here (check_schema reads them)."""
    rules: dict[str, list[tuple[str, str]]] = {}
    tokens: list[tuple[str, str]] | None = None
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(grammar):
        match = _LARK_TOKEN.match(grammar, pos)
        assert match is not None  # `other` matches any character
        kind, text, pos = match.lastgroup, match.group(0), match.end()
        if kind == "rule":
            tokens = rules.setdefault(match.group("name"), [])
            continue
        if kind == "json":
            try:
                _, pos = decoder.raw_decode(grammar, pos)
            except json.JSONDecodeError:
                pass  # llguidance reports it
            kind = "choice"
        elif kind == "string":
            try:
                value = json.loads(text.removesuffix("i"))
            except json.JSONDecodeError:
                value = text[1:-1]
            if (why := literal_error(value)) is not None:
                return why
        elif kind == "regex":
            if (why := regex_repeat_error(text[1:text.rindex("/")])) is not None:
                return why
            kind = "choice"
        elif kind == "count":
            lo = int(match.group("lo") or match.group("tlo"))
            exact = not (match.group("hi") or match.group("thi"))
            text = f"{lo},{int(exact)}"
        if tokens is not None and kind not in ("comment", "nl", None):
            tokens.append((kind, text))
    runs = _rule_runs(rules)
    for name in rules:
        run = runs[name]
        num_lexemes = max(run.prefix, run.inner, run.suffix) if name != "start" else longest_after_start(run)
        if num_lexemes > MAX_FORCED_LEXEMES:
            return (f"the rule {name!r} forces a run of {num_lexemes} lexemes after a choice; at most "
                    f"{MAX_FORCED_LEXEMES} are supported")
    return None


def _rule_runs(rules: dict[str, list[tuple[str, str]]]) -> dict[str, Run]:
    """Each rule's run, the rules it names first (depth first, on an explicit stack: a chain of thousands of rules
    that each name the next passed Python's recursion limit); a rule named again while its own run is being found
    (recursion) counts as the model's choice there."""
    runs: dict[str, Run] = {}
    for root in rules:
        stack, on_path = [root], set()
        while stack:
            name = stack[-1]
            if name in runs:
                stack.pop()
                continue
            if name not in on_path:
                on_path.add(name)
                named = [text for kind, text in rules[name] if kind == "ref"]
                pending = [ref for ref in named if ref in rules and ref not in runs and ref not in on_path]
                if pending:
                    stack.extend(reversed(pending))
                    continue
            runs[name] = _rule_run(name, rules, runs, on_path - {name})  # every rule it names is known or on the path
            on_path.discard(name)
            stack.pop()
    return runs


def _rule_run(name: str, rules: dict[str, list[tuple[str, str]]], runs: dict[str, Run], seen: set[str]) -> Run:
    if name in runs:
        return runs[name]
    if name not in rules or name in seen:  # a terminal or a recursive rule: counted as the model's choice
        return FORCED_NOTHING
    seen.add(name)
    run, _ = _alternatives(rules[name], 0, rules, runs, seen)
    runs[name] = run
    return run


def _alternatives(tokens: list[tuple[str, str]], i: int, rules: dict[str, list[tuple[str, str]]],
                  runs: dict[str, Run], seen: set[str]) -> tuple[Run, int]:
    """The run of `a | b | ...` from tokens[i] to a closing bracket (or the end), and the index past it."""
    options: list[Run] = []
    pieces: list[Run] = []
    while i < len(tokens):
        kind, text = tokens[i]
        i += 1
        if kind == "op" and text in ")]":
            break
        if kind == "op" and text == "|":
            options.append(sequence(pieces))
            pieces = []
        elif kind == "op" and text in "([":
            inner, i = _alternatives(tokens, i, rules, runs, seen)
            pieces.append(inner if text == "(" else repeat(inner, 0, False))
        elif kind == "op" and pieces:  # ? * +
            pieces[-1] = repeat(pieces[-1], int(text == "+"), False)
        elif kind == "count" and pieces:
            lo, exact = text.split(",")
            pieces[-1] = repeat(pieces[-1], int(lo), exact == "1")
        elif kind in ("string", "special"):
            pieces.append(forced(1))
        elif kind == "ref":
            pieces.append(_rule_run(text, rules, runs, seen))
        elif kind in ("choice", "other"):
            pieces.append(FORCED_NOTHING)
    options.append(sequence(pieces))
    if len(options) == 1:
        return options[0], i
    return Run(0, max(longest_after_start(o) for o in options), 0, False), i


def _repeats_forced_text(regex: str) -> bool:
    """Whether a regex is one repetition of forced text (`a*`, `(ab)+`)."""
    try:
        pattern = list(sre.parse(regex))
    except (re.error, OverflowError, RecursionError, ValueError):
        return False
    return len(pattern) == 1 and pattern[0][0] in _REPEATS and _regex_run(pattern[0][1][2]).forced
