"""Structured outputs: a request's constraint becomes an llguidance grammar, checked once per tokenizer and cached.

Where each part runs (issue 12):

- api: OpenAI's `response_format` and vLLM's `structured_outputs` / `guided_*` become one `StructuredOutputs`
  inside SamplingParams (shape checks only).
- tokenizer process: `GrammarChecker.check` (this module) turns the constraint into llguidance's grammar text
  and compiles it against the real tokenizer, off the worker's step loop. Results are cached per constraint
  (LRU, bounded), so a repeated schema costs a dict lookup. A grammar the library rejects is an
  InvalidRequestError (400) with llguidance's reason.
- the constraint travels as it came, inside SamplingParams: tokenizer -> scheduler (which never looks inside)
  -> worker (NewRequest.sampling). llguidance has no serialized compiled form to ship, and building a matcher
  from the grammar text takes milliseconds (a 50-field schema: ~3 ms), so the worker rebuilds it, cached.
- worker (services/worker/grammar.py): one matcher per sequence, built from this module's grammar text; each
  step it fills the bitmask of the rows that sample under a grammar, on the host, after the previous token was
  accepted, and applies it to their logits on the device; the sampled tokens then advance the matchers.

`grammar_text` is pure and shared by the tokenizer and the worker, so both compile the same grammar. This package
imports neither tier: the worker builds llguidance's tokenizer here (`load_ll_tokenizer`), without the tokenizer's.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import msgspec
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from pagoda.services.grammar.repetition import fixed_json_error, lark_repeat_error, literal_error, regex_repeat_error
from pagoda.services.grammar.vocab import model_ll_tokenizer
from pagoda.shared.config import SLOW_COMPILE_MIN_BYTES
from pagoda.shared.errors import InvalidRequestError, ModelNotFoundError
from pagoda.shared.hf_tokenizer import has_tokenizer, load_hf_tokenizer
from pagoda.shared.messages import SamplingParams, StructuredOutputs
from pagoda.shared.schema_walk import visit_keywords

log = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 512  # distinct constraints remembered per process
CONSTRAINT_PARAM = "structured_outputs"  # what a constraint's error names: SamplingParams' field (the api: the body's)
# JSON as json.dumps writes it: no free whitespace, which small models otherwise fill with runs of newlines and
# indentation until max_tokens (a schema's "x-guidance" options still override these).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# StructuredOutputs.disable_any_whitespace: llguidance's own separators without free whitespace, compact JSON (what
# vLLM's guidance backend writes with its disable_any_whitespace)
COMPACT_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


def json_options(constraint: StructuredOutputs) -> dict[str, Any]:
    """How the constraint's JSON is written (a schema's own x-guidance still wins): JSON_OPTIONS, compact with
    disable_any_whitespace, or with whitespace_pattern's whitespace between its tokens (llguidance's separators)."""
    if constraint.whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": constraint.whitespace_pattern}
    return COMPACT_JSON_OPTIONS if constraint.disable_any_whitespace else JSON_OPTIONS


def closed_objects(schema: Any) -> Any:
    """vLLM's disable_additional_properties: a copy of `schema` in which every object schema with properties or
    patternProperties and no additionalProperties of its own has `additionalProperties: false` (every dict of
    the tree is looked at, as vLLM's walk does). Walked on an explicit stack: schemas nest deeper than Python's
    recursion limit."""
    root = [schema]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        parent, key = stack.pop()
        value = parent[key]
        if isinstance(value, dict):
            value = dict(value)
            if "additionalProperties" not in value and ("properties" in value or "patternProperties" in value):
                value["additionalProperties"] = False
        elif isinstance(value, list):
            value = list(value)
        else:
            continue
        parent[key] = value
        stack.extend((value, k) for k in (value if isinstance(value, dict) else range(len(value))))
    return root[0]


# How a grammar names a special token (<|python_tag|>); structural-tag triggers of that form may be one
_SPECIAL_TOKEN_RE = re.compile(r"<[^<>\s\"]+>")

# ECMAScript's shorthand classes, which JSON Schema patterns use (llguidance reads those so) and vLLM's default
# structured-output backend gives its regexes: llguidance's plain regexes are Rust's, where \d, \w and \s are
# Unicode classes (a phone-number regex \d{3} admitted Kannada digits, three tokens each).
_ASCII_SHORTHANDS = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]",
                     "s": "[ \\t\\n\\r\\f\\x0B]", "S": "[^ \\t\\n\\r\\f\\x0B]"}


def ascii_shorthands(regex: str) -> str:
    """regex with \\d \\D \\w \\W \\s \\S as ASCII classes (nested classes inside brackets, which Rust's syntax
    allows); every other escape, an escaped backslash included, is left as written. ValueError for a regex that
    ends in a lone backslash (an escape of nothing, which llguidance took for the empty regex)."""
    out: list[str] = []
    i = 0
    while i < len(regex):
        if regex[i] == "\\":
            if i + 1 == len(regex):
                raise ValueError("the regex ends in a lone backslash (an escape of nothing)")
            out.append(_ASCII_SHORTHANDS.get(regex[i + 1], regex[i:i + 2]))
            i += 2
        else:
            out.append(regex[i])
            i += 1
    return "".join(out)


_GBNF_RULE = re.compile(r"[\w-]+\s*::=")  # GBNF's `name ::= ...` (Lark's is `name: ...`)


def as_lark(grammar: str) -> str:
    """A grammar constraint's text as Lark: GBNF (llama.cpp's, as vLLM's xgrammar backend takes it) converted, Lark
    as it is."""
    return gbnf_to_lark(gbnf_unicode_escapes(grammar)) if is_gbnf(grammar) else grammar


_GBNF_ESCAPE = re.compile(r"\\(?:u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8})|.)", re.DOTALL)


def gbnf_unicode_escapes(grammar: str) -> str:
    """A GBNF grammar with llama.cpp's \\uXXXX and \\UXXXXXXXX escapes written as llguidance's converter reads
    them: a code point up to 0xFF as \\xHH, any other as the character itself (never one GBNF gives a meaning). The
    converter turned them into \\u41 and \\U1F600, which its regexes and literals refuse ("invalid hexadecimal
    digit"), so a grammar with [\\u0041-\\u005A] was a 400. Other escapes, an escaped backslash among them, stay.
    ValueError for a code point that is not a Unicode scalar value (a surrogate, or past 0x10FFFF)."""

    def rewrite(match: re.Match[str]) -> str:
        digits = match.group(1) or match.group(2)
        if digits is None:
            return match.group(0)
        code = int(digits, 16)
        if 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
            raise ValueError(f"{match.group(0)} is not a Unicode character")
        return f"\\x{code:02X}" if code <= 0xFF else chr(code)

    return _GBNF_ESCAPE.sub(rewrite, grammar)


def is_gbnf(grammar: str) -> bool:
    """Whether a grammar is GBNF rather than Lark: its first rule, past blank and comment lines, is `name ::=`.
    A "::=" elsewhere decides nothing: a Lark grammar may hold one in a literal, a regex or a comment (looking for
    it anywhere refused `start: "x ::= y"` as broken GBNF)."""
    for line in grammar.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "//")):
            return _GBNF_RULE.match(line) is not None
    return False


# llguidance reads a numeric bound through a float and a 64-bit integer: past 2**53 it rounds (an integer maximum of
# 9223372036854775800 let 9223372036854775807 through) and saturates (a minimum of 1e29 allowed only 2**63 - 1), and
# a range at the bottom of the 64-bit integers crashed the process that compiled it (the tokenizer's: one request
# stopped the server). Such bounds are refused; an upper one at or past the top of the 64-bit range only restates it.
MAX_EXACT_BOUND = 2**53
_BOUNDS = frozenset({"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"})


def _bound_is_exact(key: str, value: float) -> bool:
    return (abs(value) <= MAX_EXACT_BOUND or (key == "maximum" and value >= 2**63 - 1)
            or (key == "exclusiveMaximum" and value >= 2**63))


def _check_bound(key: str, value: Any, at: str) -> None:
    if key in _BOUNDS and isinstance(value, int | float) and not isinstance(value, bool) \
            and not _bound_is_exact(key, value):
        raise InvalidRequestError(
            f"the JSON schema's {key} at {at} ({value}) cannot be enforced: numeric bounds must be within "
            f"+-2**53 ({MAX_EXACT_BOUND}), where they are exact", param=CONSTRAINT_PARAM)


def _check_pattern(key: str, value: Any, at: str) -> None:
    patterns: list[tuple[str, str]] = []  # (where, regex)
    if key == "pattern" and isinstance(value, str):
        patterns = [(at, value)]
    elif key == "patternProperties" and isinstance(value, dict):  # its names are regexes
        patterns = [(f"{at}/{name}", name) for name in value]
    for where, pattern in patterns:
        if (why := regex_repeat_error(pattern)) is not None:
            raise InvalidRequestError(f"the JSON schema's pattern at {where}: {why}", param=CONSTRAINT_PARAM)


def _check_keyword(key: str, value: Any, at: str) -> None:
    _check_bound(key, value, at)
    _check_pattern(key, value, at)
    if key in ("const", "enum") and at != "/const":  # data: the text a value forces (the root's is walked at once)
        for i, item in enumerate(value if key == "enum" and isinstance(value, list) else [value]):
            if (why := literal_error(json.dumps(item, ensure_ascii=False))) is not None:
                where = f"{at}/{i}" if key == "enum" else at
                raise InvalidRequestError(f"the JSON schema's {key} at {where}: {why}", param=CONSTRAINT_PARAM)


def check_schema(schema: Any) -> None:
    """InvalidRequestError naming the first numeric bound of a JSON schema that llguidance cannot hold exactly, or
    the first pattern with a repetition, or const or enum value, too long for it to force (repetition.py)."""
    visit_keywords(schema, _check_keyword)
    _check_fixed(schema, "")


def _check_fixed(node: Any, at: str) -> None:
    """fixed_json_error for each schema object at any depth (data keywords' values skipped)."""
    if isinstance(node, dict):
        if (why := fixed_json_error(node)) is not None:
            raise InvalidRequestError(f"the JSON schema at {at or '/'}: {why}", param=CONSTRAINT_PARAM)
        for key, value in node.items():
            if key not in ("const", "enum", "default", "examples"):
                _check_fixed(value, f"{at}/{key}")
    elif isinstance(node, list):
        for i, item in enumerate(node):
            _check_fixed(item, f"{at}/{i}")


def _check_lark(grammar: str) -> None:
    """A Lark grammar's repetitions (repetition.py), and check_schema for each JSON schema it embeds
    (`%json {...}`)."""
    if (why := lark_repeat_error(grammar)) is not None:
        raise InvalidRequestError(why, param=CONSTRAINT_PARAM)
    decoder = json.JSONDecoder()
    for match in re.finditer(r"%json\s*", grammar):
        try:
            schema, _ = decoder.raw_decode(grammar, match.end())
        except json.JSONDecodeError:
            continue  # llguidance reports it
        check_schema(schema)
        if isinstance(schema, dict) and "const" in schema:  # not the grammar's start here: checked like any const
            if (why := literal_error(json.dumps(schema["const"], ensure_ascii=False))) is not None:
                raise InvalidRequestError(f"the JSON schema's const at /const: {why}", param=CONSTRAINT_PARAM)


def grammar_text(constraint: StructuredOutputs, tokenizer: llguidance.LLTokenizer | None = None) -> str:
    """llguidance's grammar for a constraint (not yet checked; `compile_error` does that). `tokenizer`: the one it
    will run with, which tells a structural tag's triggers that are special tokens (None: none are)."""
    matcher = llguidance.LLMatcher
    try:
        if constraint.json is not None:
            schema = json.loads(constraint.json) if isinstance(constraint.json, str) else constraint.json
            if not isinstance(schema, dict):
                raise InvalidRequestError("a JSON schema must be an object", param=CONSTRAINT_PARAM)
            check_schema(schema)
            if constraint.disable_additional_properties:
                schema = closed_objects(schema)
            return matcher.grammar_from_json_schema(schema, defaults=json_options(constraint))
        if constraint.regex is not None:
            if (why := regex_repeat_error(constraint.regex, at_start=True)) is not None:
                raise InvalidRequestError(why, param=CONSTRAINT_PARAM)
            return matcher.grammar_from_regex(ascii_shorthands(constraint.regex))
        if constraint.choice is not None:
            # Lark string literals take JSON's escapes, so each choice is matched verbatim.
            text = "start: " + " | ".join(json.dumps(c) for c in constraint.choice)
            _check_lark(text)
            return matcher.grammar_from_lark(text)
        if constraint.structural_tag is not None:
            spec = json.loads(constraint.structural_tag)
            if "format" in spec:  # xgrammar's form
                return structural_format_grammar(spec["format"], tokenizer)
            text = structural_tag_lark(constraint.structural_tag, tokenizer, constraint)
            _check_lark(text)
            return matcher.grammar_from_lark(text)
        if constraint.grammar is not None:
            text = as_lark(constraint.grammar)
            _check_lark(text)
            return matcher.grammar_from_lark(text)
        return matcher.grammar_from_json_schema({"type": "object"}, defaults=json_options(constraint))
    except InvalidRequestError:
        raise
    except Exception as exc:  # the library's own parse errors (bad JSON text, bad GBNF)
        raise InvalidRequestError(f"invalid {constraint.kind} for structured outputs: {exc}",
                                  param=CONSTRAINT_PARAM) from exc


def structural_tag_lark(spec_text: str, tokenizer: llguidance.LLTokenizer | None = None,
                        constraint: StructuredOutputs | None = None) -> str:
    """The Lark grammar of a structural tag (StructuredOutputs.validate checked its shape): free text, in which each
    trigger goes on as one of the structures whose begin starts with it (its first such trigger, as vLLM's guidance
    backend pairs them): the rest of `begin`, JSON of its schema (written as every JSON constraint here:
    `constraint`'s json_options and disable_additional_properties), `end`; then free text again. A text trigger is a
    lazy lexeme (it matches where it first appears); one that is a special token of `tokenizer` is that token."""
    spec = json.loads(spec_text)
    json_form = json_options(constraint) if constraint is not None else JSON_OPTIONS
    close = constraint is not None and constraint.disable_additional_properties
    rules = []
    for i, structure in enumerate(spec["structures"]):
        begin, end, schema = structure["begin"], structure["end"], structure["schema"]
        trigger = next(t for t in spec["triggers"] if begin.startswith(t))
        if close:
            schema = closed_objects(schema)
        options = {**json_form, **schema.get("x-guidance", {})}  # the schema's own options win, as elsewhere
        parts = [json.dumps(begin[len(trigger):]) if begin != trigger else "",
                 f"%json {json.dumps({**schema, 'x-guidance': options})}", json.dumps(end) if end else ""]
        body = " ".join(part for part in parts if part)
        if tokenizer is not None and _is_special_token(tokenizer, trigger):
            rules.append(f"tag_{i}: FREE_TEXT {trigger} {body}")
        else:
            rules += [f"tag_{i}_trigger[lazy]: FREE_TEXT {json.dumps(trigger)}", f"tag_{i}: tag_{i}_trigger {body}"]
    tags = " | ".join(f"tag_{i}" for i in range(len(spec["structures"])))
    return "\n".join(["%llguidance {}", f"start: ({tags})* FREE_TEXT", r"FREE_TEXT: /(.|\n)*/", *rules])


def _is_special_token(tokenizer: llguidance.LLTokenizer, text: str) -> bool:
    """Whether `text` is one special token of the tokenizer (`<|python_tag|>`, `<tool_call>`), which a grammar
    names as `<...>`: its text would not match it (this project's tokenizers never spell text into special tokens,
    vocab.py). Asked of llguidance itself, ~2 ms, once per compile."""
    if not _SPECIAL_TOKEN_RE.fullmatch(text):
        return False
    return not llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(f"start: {text}"),
                                                     tokenizer)


# --------------------------------------------------------------------------------------------
# xgrammar's structural tag, `{"format": {...}}`: a tree of formats (StructuredOutputs.validate checked its shape)
# compiled to one Lark grammar for llguidance, with a side grammar per `grammar` / `regex` node.
#
# Free text (any_text, and the text between triggered tags or dispatch patterns) must know where it ends, since
# llguidance's lexemes are greedy: it ends the output, or is one lazy lexeme with what follows it (the enclosing tag's
# end, or a const_string after it in a sequence that it excludes), which ends where that first appears; xgrammar
# likewise keeps the enclosing tag's end out of such text. Free text with nothing of the kind after it is refused.

# What follows a format, which its expression takes in: None, the end of the output; a tuple of strings, one of
# them (the expression ends with it); (), something else, which the caller writes.
Follow = tuple[str, ...] | None
_ANY_TEXT = r"/(.|\n)*/"
_UNENDED = ("free text here has nothing to end it: it must end the output, or a tag's content, or come before a "
            "const_string that it excludes")


@dataclass(slots=True)
class _FormatGrammar:
    """The grammar a structural tag's format becomes, built node by node: rules of its main Lark grammar, side
    grammars (a `grammar` or `regex` node's own, each with its start rule and lexer) and free-text terminals."""

    tokenizer: llguidance.LLTokenizer | None
    rules: list[str] = field(default_factory=list)
    side_grammars: list[dict[str, Any]] = field(default_factory=list)
    texts: dict[tuple[str, ...], str] = field(default_factory=dict)  # excluded strings -> terminal of free text
    specials: dict[str, bool] = field(default_factory=dict)  # `<...>` -> whether it is a special token
    # id of a tag format -> the rule of its content: triggered_tags with at_least_one writes each tag twice (whole,
    # then after its trigger), which nested would double the grammar at every level (2^14 copies at the depth bound)
    contents: dict[int, str] = field(default_factory=dict)

    def rule(self, body: str, lazy: bool = False) -> str:
        """A new rule of `body`; its name. A lazy rule is one lexeme that ends where it first can."""
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def side(self, grammar: dict[str, Any]) -> str:
        """A side grammar; how the main grammar names it."""
        name = f"g{len(self.side_grammars)}"
        self.side_grammars.append({**grammar, "name": name})
        return "@" + name

    def text(self, excludes: Sequence[str]) -> str:
        """The terminal of free text in which none of `excludes` appears."""
        key = tuple(sorted(set(excludes)))
        if key not in self.texts:
            body = _ANY_TEXT if not key else (f"{_ANY_TEXT} & ~({_ANY_TEXT} ("
                                              + " | ".join(json.dumps(s) for s in key) + f") {_ANY_TEXT})")
            self.texts[key] = f"TEXT_{len(self.texts)}: {body}"
        return self.texts[key].split(":", 1)[0]

    def is_special(self, text: str) -> bool:
        if text not in self.specials:
            self.specials[text] = self.tokenizer is not None and _is_special_token(self.tokenizer, text)
        return self.specials[text]

    def literal(self, text: str) -> str:
        """`text` matched verbatim, where a `<...>` in it that is a special token of the tokenizer is that token."""
        parts: list[str] = []
        start = 0
        for match in _SPECIAL_TOKEN_RE.finditer(text):
            if self.is_special(match.group()):
                parts += [json.dumps(text[start:match.start()])] if match.start() > start else []
                parts.append(match.group())
                start = match.end()
        parts += [json.dumps(text[start:])] if start < len(text) or not parts else []
        return " ".join(parts)

    def lark(self, start: str) -> str:
        return "\n".join(["%llguidance {}", f"start: {start}", *self.rules, *self.texts.values()])


def structural_format_grammar(fmt: dict[str, Any], tokenizer: llguidance.LLTokenizer | None = None) -> str:
    """llguidance's grammar for an xgrammar structural tag's `format`: its main Lark grammar (with a side grammar for
    each `grammar` and `regex` node). `tokenizer` tells the `<...>` strings that are its special tokens (None: none
    are); each is that token wherever it is written (a begin, an end, a trigger, a const_string)."""
    built = _FormatGrammar(tokenizer)
    main = built.lark(_format_expr(built, fmt, "format", None, ()))
    _check_lark(main)
    if not built.side_grammars:
        return llguidance.LLMatcher.grammar_from_lark(main)
    return json.dumps({"grammars": [{"name": "structural_tag", "lark_grammar": main}, *built.side_grammars]})


def _refuse(at: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"structural_tag's {at}: {why}", param=CONSTRAINT_PARAM)


def _format_expr(g: _FormatGrammar, node: dict[str, Any], at: str, follow: Follow, tag_ends: tuple[str, ...]) -> str:
    """The Lark expression of format `node` (standing at `at`) followed by `follow`; `tag_ends`: the end strings of
    the tag it is inside, which its free text never holds (as xgrammar keeps them out)."""
    kind = node.get("type", "tag")
    return _FORMAT_EXPRS[kind](g, node, at, follow, tag_ends)


def _then(g: _FormatGrammar, expr: str, follow: Follow) -> str:
    """`expr` followed by `follow` (nothing for None and ())."""
    if not follow:
        return expr
    return f"{expr} ({' | '.join(g.literal(s) for s in follow)})"


def _until(g: _FormatGrammar, excludes: Sequence[str], delimiter: str, at: str) -> str:
    """Free text without `excludes`, up to and with the first `delimiter`. Text before a special token is greedy
    (the token is no text); text before a string is one lazy lexeme with it."""
    if not delimiter:
        raise _refuse(at, "an empty string cannot end free text")
    first = _SPECIAL_TOKEN_RE.search(delimiter)
    special = first is not None and g.is_special(first.group())
    if special and first is not None and first.start() == 0:
        return g.rule(f"{g.text(excludes)} {g.literal(delimiter)}")
    if special:
        raise _refuse(at, f"free text cannot end at {delimiter!r}: text then a special token inside it")
    return g.rule(f"{g.text(excludes)} {json.dumps(delimiter)}", lazy=True)


def _free_text(g: _FormatGrammar, excludes: Sequence[str], follow: Follow, at: str) -> str:
    """Free text without `excludes`, then `follow`: to the end of the output, or to the first of follow's strings."""
    if follow is None:
        return g.text(excludes)
    if not follow:
        raise _refuse(at, _UNENDED)
    return "(" + " | ".join(_until(g, excludes, end, at) for end in follow) + ")"


def _const_string_expr(g: _FormatGrammar, node: dict[str, Any], at: str, follow: Follow,
                       tag_ends: tuple[str, ...]) -> str:
    return _then(g, g.literal(node["value"]), follow)


def _json_schema_expr(g: _FormatGrammar, node: dict[str, Any], at: str, follow: Follow,
                      tag_ends: tuple[str, ...]) -> str:
    """JSON as every JSON constraint here writes it (JSON_OPTIONS, no free whitespace: within any
    max_whitespace_cnt of 1 or more; 0 drops the separators' spaces too); the schema's own x-guidance wins."""
    schema = node["json_schema"] if isinstance(node["json_schema"], dict) else {}
    options = dict(JSON_OPTIONS)
    if node.get("max_whitespace_cnt") == 0:
        options.update(item_separator=",", key_separator=":")
    schema = {**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}}
    return _then(g, f"%json {json.dumps(schema)}", follow)


def _grammar_expr(g: _FormatGrammar, node: dict[str, Any], at: str, follow: Follow,
                  tag_ends: tuple[str, ...]) -> str:
    """A grammar as the `grammar` constraint takes it: Lark, or GBNF (xgrammar's EBNF, `root ::= ...`)."""
    text = node["grammar"]
    try:
        text = as_lark(text)
    except Exception as exc:
        raise _refuse(f"{at}.grammar", f"invalid GBNF: {exc}") from exc
    _check_lark(text)
    return _then(g, g.side({"lark_grammar": text}), follow)


def _regex_expr(g: _FormatGrammar, node: dict[str, Any], at: str, follow: Follow, tag_ends: tuple[str, ...]) -> str:
    """A regex as the `regex` constraint takes it (ECMAScript's ASCII shorthands), matched whole."""
    pattern = node["pattern"]
    if (why := regex_repeat_error(pattern)) is not None:
        raise _refuse(f"{at}.pattern", why)
    try:
        [side] = json.loads(llguidance.LLMatcher.grammar_from_regex(ascii_shorthands(pattern)))["grammars"]
    except ValueError as exc:
        raise _refuse(f"{at}.pattern", str(exc)) from exc
    return _then(g, g.side(side), follow)


def _any_text_expr(g: _FormatGrammar, node: dict[str, Any], at: str, follow: Follow,
                   tag_ends: tuple[str, ...]) -> str:
    return _free_text(g, [*node.get("excludes", []), *(e for e in tag_ends if e)], follow, at)


_FREE_TEXT_KINDS = ("any_text", "triggered_tags", "dispatch")


def _sequence_expr(g: _FormatGrammar, node: dict[str, Any], at: str, follow: Follow,
                   tag_ends: tuple[str, ...]) -> str:
    """Each element then the next; free text followed by a const_string it excludes ends at that string."""
    elements, parts, i = node["elements"], [], 0
    while i < len(elements):
        element, where = elements[i], f"{at}.elements[{i}]"
        after = elements[i + 1] if i + 1 < len(elements) else None
        if after is None:
            parts.append(_format_expr(g, element, where, follow, tag_ends))
        elif (element.get("type") in _FREE_TEXT_KINDS and after.get("type") == "const_string" and after["value"]
              and after["value"] in [*element.get("excludes", []), *tag_ends]):
            expr = _format_expr(g, element, where, (after["value"],), tag_ends)
            parts.append(_then(g, expr, follow) if i + 2 == len(elements) else expr)
            i += 1
        else:
            parts.append(_format_expr(g, element, where, (), tag_ends))
        i += 1
    return " ".join(part for part in parts if part)


def _or_expr(g: _FormatGrammar, node: dict[str, Any], at: str, follow: Follow, tag_ends: tuple[str, ...]) -> str:
    branches = [_format_expr(g, element, f"{at}.elements[{i}]", follow, tag_ends)
                for i, element in enumerate(node["elements"])]
    return "(" + " | ".join(branches) + ")"


def _repeat_expr(g: _FormatGrammar, node: dict[str, Any], at: str, follow: Follow,
                 tag_ends: tuple[str, ...]) -> str:
    """optional, plus, star and repeat: their content (which must end on its own) so many times, then follow."""
    kind = node.get("type")
    low, high = {"optional": (0, 1), "plus": (1, -1), "star": (0, -1)}.get(kind, (node.get("min"), node.get("max")))
    assert isinstance(low, int) and isinstance(high, int)
    if high == 0:
        return _then(g, '""', follow)
    content = g.rule(_format_expr(g, node["content"], f"{at}.content", (), tag_ends))
    return _then(g, f"{content}{{{low},{'' if high == -1 else high}}}", follow)


def _tag_ends(node: dict[str, Any]) -> tuple[str, ...]:
    end = node["end"]
    return (end,) if isinstance(end, str) else tuple(end)


def _tag_expr(g: _FormatGrammar, node: dict[str, Any], at: str, follow: Follow, tag_ends: tuple[str, ...],
              skip: int = 0) -> str:
    """begin (less its first `skip` characters: a trigger written already), content, one of the ends; then
    follow. Free text in the content ends at the first end."""
    ends = _tag_ends(node)
    body = g.contents.get(id(node))
    if body is None:  # the content, followed by its ends, does not depend on skip or follow: one rule
        body = g.contents[id(node)] = g.rule(_format_expr(g, node["content"], f"{at}.content", ends, ends))
    begin = node["begin"][skip:]
    return _then(g, f"{g.literal(begin)} {body}" if begin else body, follow)


def _tags_expr(g: _FormatGrammar, node: dict[str, Any], at: str, tag_ends: tuple[str, ...]) -> str:
    """One of node's tags, whole."""
    return "(" + " | ".join(_tag_expr(g, tag, f"{at}.tags[{i}]", (), tag_ends)
                            for i, tag in enumerate(node["tags"])) + ")"


def _dispatch(g: _FormatGrammar, cases: list[tuple[str, Callable[[Follow], str]]], excludes: Sequence[str],
              loop: bool, follow: Follow, at: str) -> str:
    """Free text in which each trigger goes on as its case (`cases`: trigger, its expression with a given
    follow): again and again while `loop`, else once at most; then free text to `follow`. A trigger never stays
    text."""
    if loop:
        steps = " | ".join(f"{_until(g, excludes, trigger, at)} {case(())}" for trigger, case in cases)
        return f"({steps})* {_free_text(g, excludes, follow, at)}"
    if follow == ():  # after its one case, the caller's part comes: the case is one rule, taken or not
        raise _refuse(at, _UNENDED)
    steps = " | ".join(f"{_until(g, excludes, trigger, at)} {case(follow)}" for trigger, case in cases)
    return f"({steps} | {_free_text(g, excludes, follow, at)})"


def _triggered_tags_expr(g: _FormatGrammar, node: dict[str, Any], at: str, follow: Follow,
                         tag_ends: tuple[str, ...]) -> str:
    """Free text in which a trigger goes on as one of the tags whose begin starts with it; at_least_one: a tag
    first (no text before it); stop_after_first: the format ends after one tag."""
    if node.get("at_least_one") and node.get("stop_after_first"):
        return _then(g, _tags_expr(g, node, at, tag_ends), follow)
    excludes = [*node.get("excludes", []), *(e for e in tag_ends if e)]
    cases = [(trigger, _trigger_case(g, node, at, trigger, tag_ends)) for trigger in node["triggers"]]
    if node.get("at_least_one"):
        return f"{_tags_expr(g, node, at, tag_ends)} {_dispatch(g, cases, excludes, True, follow, at)}"
    return _dispatch(g, cases, excludes, not node.get("stop_after_first"), follow, at)


def _trigger_case(g: _FormatGrammar, node: dict[str, Any], at: str, trigger: str,
                  tag_ends: tuple[str, ...]) -> Callable[[Follow], str]:
    tags = [(i, tag) for i, tag in enumerate(node["tags"]) if tag["begin"].startswith(trigger)]

    def case(follow: Follow) -> str:
        return "(" + " | ".join(_tag_expr(g, tag, f"{at}.tags[{i}]", follow, tag_ends, skip=len(trigger))
                                for i, tag in tags) + ")"
    return case


def _dispatch_expr(g: _FormatGrammar, node: dict[str, Any], at: str, follow: Follow,
                   tag_ends: tuple[str, ...]) -> str:
    """Free text in which each pattern (written as text) goes on as its format; loop: again and again."""
    def case_of(i: int, fmt: dict[str, Any]) -> Callable[[Follow], str]:
        return lambda after: _format_expr(g, fmt, f"{at}.rules[{i}][1]", after, tag_ends)

    cases = [(pattern, case_of(i, fmt)) for i, (pattern, fmt) in enumerate(node["rules"])]
    excludes = [*node.get("excludes", []), *(e for e in tag_ends if e)]
    return _dispatch(g, cases, excludes, node.get("loop", True), follow, at)


def _tags_with_separator_expr(g: _FormatGrammar, node: dict[str, Any], at: str, follow: Follow,
                              tag_ends: tuple[str, ...]) -> str:
    """Tags and nothing else, separator between them: none or more (at_least_one: one or more; stop_after_first:
    at most one)."""
    tags = g.rule(_tags_expr(g, node, at, tag_ends))
    separator = f"{g.literal(node['separator'])} " if node["separator"] else ""
    many = tags if node.get("stop_after_first") else f"{tags} ({separator}{tags})*"
    return _then(g, many if node.get("at_least_one") else f"({many})?", follow)


_FORMAT_EXPRS: dict[str, Callable[[_FormatGrammar, dict[str, Any], str, Follow, tuple[str, ...]], str]] = {
    "const_string": _const_string_expr, "json_schema": _json_schema_expr, "grammar": _grammar_expr,
    "regex": _regex_expr, "any_text": _any_text_expr, "sequence": _sequence_expr, "or": _or_expr,
    "optional": _repeat_expr, "plus": _repeat_expr, "star": _repeat_expr, "repeat": _repeat_expr, "tag": _tag_expr,
    "triggered_tags": _triggered_tags_expr, "tags_with_separator": _tags_with_separator_expr,
    "dispatch": _dispatch_expr}


def ll_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer; masks are `vocab_size` bits wide (the model's logits), and a
    finished grammar allows exactly the model's EOS ids (those the tokenizer has: a dummy-weight shape served with
    some real tokenizer may name others). Text a grammar forces is never tokenized into a special token (vocab.py)."""
    return model_ll_tokenizer(hf_tokenizer, vocab_size, eos_token_ids)


def load_ll_tokenizer(folder: str, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for the Hugging Face tokenizer in `folder` (the worker's masks: the model's vocabulary
    width, its EOS ids and the tokenizer's own). Built once a process for a folder whose files are unchanged (an
    immutable object, shared by every matcher): ~0.6-0.9 s of each in-process engine's build on the 2-core host,
    and the test suite builds ~120 engines."""
    if not has_tokenizer(folder):
        raise ModelNotFoundError(f"no tokenizer found in folder {folder!r}")
    return _built_ll_tokenizer(folder, _folder_stamp(folder), vocab_size, tuple(sorted(set(eos_token_ids))))


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def _folder_stamp(folder: str) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime) of the folder's files other than weights: a rewritten tokenizer builds anew."""
    with os.scandir(folder) as entries:
        return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries
                            if e.is_file() and not e.name.endswith(_WEIGHT_SUFFIXES)))


@functools.lru_cache(maxsize=4)
def _built_ll_tokenizer(folder: str, stamp: tuple[tuple[str, int, int], ...], vocab_size: int,
                        eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    del stamp  # part of the key only
    hf_tokenizer = load_hf_tokenizer(folder)
    eos_ids = set(eos_token_ids)
    if hf_tokenizer.eos_token_id is not None:
        eos_ids.add(hf_tokenizer.eos_token_id)
    return ll_tokenizer(hf_tokenizer, vocab_size, sorted(eos_ids))


REASONING_END = "</think>"


# llguidance builds a grammar by recursion over its rules and schema nodes, 3-8 KB of native stack a level: a JSON
# schema of $refs that each reach the next needs ~8 KB a level (up to llguidance's node limit, ~15,000), a Lark chain of
# rules that each name the next up to ~500 bytes of stack per byte of grammar text (MAX_GRAMMAR_CHARS of it: ~500 MB).
# On a thread's usual 8 MB a chain of ~1,000 $refs (60 KB of request) overflowed it: SIGSEGV in the process that
# compiled it (the tokenizer's stopped the server). Only the part of the stack a compile uses is committed.
COMPILE_STACK_BYTES = 1 << 30
INLINE_COMPILE_MAX_CHARS = 2048  # a grammar this short needs at most ~1 MB of stack: built on the caller's thread
_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is the process's: set, start the thread, set back


def new_matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """llguidance.LLMatcher for a grammar (quiet_limits); one longer than INLINE_COMPILE_MAX_CHARS is built on a thread
    of its own with COMPILE_STACK_BYTES of stack, which the caller waits for (llguidance's compile releases the GIL)."""
    if len(grammar) <= INLINE_COMPILE_MAX_CHARS:
        return llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=quiet_limits())
    outcome: list[llguidance.LLMatcher | BaseException] = []

    def build() -> None:
        try:
            outcome.append(llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=quiet_limits()))
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            outcome.append(exc)

    with _STACK_SIZE_LOCK:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=build, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def quiet_limits() -> llguidance.LLParserLimits:
    """llguidance's default limits, with errors that leave out the parser's state and the whole grammar (its
    default appends both: a 600 KB schema's refusal or a row's failure carried the schema back into the 400's
    message and the worker's log)."""
    return llguidance.LLParserLimits(verbose_errors=False)


def constrain_after_reasoning(params: SamplingParams, prompt_closed: bool) -> SamplingParams:
    """With a reasoning parser on, the grammar applies after the model's `</think>` (its reasoning stays free),
    unless the prompt closed the think block already (`prompt_closed`: Qwen3's enable_thinking=False renders an
    empty one; the reasoning parser's prompt_reasoning decides it, so that the two agree)."""
    constraint = params.structured_outputs
    if constraint is None or prompt_closed:
        return params
    return msgspec.structs.replace(
        params, structured_outputs=msgspec.structs.replace(constraint, reasoning_end=REASONING_END))


def cache_key(constraint: StructuredOutputs) -> bytes:
    """The constraint without server-set fields: what decides the grammar."""
    return msgspec.json.encode(msgspec.structs.replace(constraint, reasoning_end=""))


@dataclass(frozen=True, slots=True)
class GrammarOutcome:
    """What compiling one constraint gave: llguidance's error, or the tokens its grammar forces at its start (its
    fast-forward tokens, see `fast_forward_tokens`) and the bitmask of the tokens it allows first."""

    error: str
    forced: list[int]
    start_mask: bytes  # 32 token ids a little-endian uint32 word, llguidance's layout; b"" with an error
    may_end_at_once: bool = False  # the grammar accepts the empty output: EOS among its first tokens

    def allows_first(self, token_ids: Sequence[int]) -> bool:
        """Whether one of token_ids may be the grammar's first token, or it may end at once (the worker then lets
        its EOS through whatever the allow-list says, GrammarRows._narrow)."""
        mask = self.start_mask
        return self.may_end_at_once or any(0 <= i < 8 * len(mask) and mask[i // 8] >> (i % 8) & 1
                                           for i in token_ids)


class GrammarChecker:
    """Compiles constraints against one tokenizer; remembers the last GRAMMAR_CACHE_SIZE outcomes."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, max_entries: int = GRAMMAR_CACHE_SIZE,
                 keep: Callable[[StructuredOutputs, llguidance.LLMatcher], None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        # keep(constraint, pristine matcher): called after a compile that built, with an unused copy of the matcher
        # (the offline engine hands it to its in-process GrammarRows, which then need not compile it again)
        self.keep = keep
        self._outcomes: OrderedDict[bytes, GrammarOutcome] = OrderedDict()
        self._lock = threading.Lock()  # the cache's; a compile runs outside it (llguidance releases the GIL)
        self.last_compile_s = 0.0  # the latest compile that missed the cache (for figures and logs)

    def cached(self, constraint: StructuredOutputs) -> bool:
        """Whether the constraint's outcome is at hand (check would not compile)."""
        key = cache_key(constraint)
        with self._lock:
            return key in self._outcomes

    def outcome(self, constraint: StructuredOutputs) -> GrammarOutcome:
        """The constraint's compile outcome, remembered or compiled now; safe on any thread (a large schema
        compiles for seconds: the tokenizer process compiles those on a thread, off its loop)."""
        key = cache_key(constraint)
        with self._lock:
            outcome = self._outcomes.get(key)
            if outcome is not None:
                self._outcomes.move_to_end(key)
                return outcome
        outcome = self._compile(constraint)
        with self._lock:
            self._outcomes[key] = outcome
            self._outcomes.move_to_end(key)
            if len(self._outcomes) > self.max_entries:
                self._outcomes.popitem(last=False)
        return outcome

    def check(self, constraint: StructuredOutputs, allowed_token_ids: Sequence[int] | None = None) -> list[int]:
        """Raise InvalidRequestError (400) unless the constraint compiles for this tokenizer and, where the request
        allows only allowed_token_ids from its first token on, one of them may start the grammar (else every
        sampled token would break it); return the token ids its grammar forces before the model has any choice
        (often empty)."""
        outcome = self.outcome(constraint)
        if outcome.error:
            raise InvalidRequestError(f"the {constraint.kind} constraint cannot be compiled: {outcome.error}",
                                      param=CONSTRAINT_PARAM)
        if allowed_token_ids and not outcome.allows_first(allowed_token_ids):
            raise InvalidRequestError(f"none of allowed_token_ids can start what the {constraint.kind} constraint "
                                      "allows", param="allowed_token_ids")
        return outcome.forced

    def _compile(self, constraint: StructuredOutputs) -> GrammarOutcome:
        started = time.perf_counter()
        try:
            grammar = grammar_text(constraint, self.tokenizer)
        except InvalidRequestError as exc:
            return GrammarOutcome(exc.message, [], b"")
        matcher = new_matcher(self.tokenizer, grammar)
        self.last_compile_s = time.perf_counter() - started
        if matcher.is_error():
            return GrammarOutcome(without_backtrace(matcher.get_error()), [], b"")
        pristine = matcher.deep_copy() if self.keep is not None else None  # before the walk below moves it
        start_mask = matcher.compute_bitmask()
        may_end = any(start_mask[i // 8] >> (i % 8) & 1 for i in self.tokenizer.eos_tokens if i < 8 * len(start_mask))
        forced = list(matcher.compute_ff_tokens())
        # Walking the forced start here is what the sequence would do first: a grammar llguidance fails on there
        # (a lexer or parser limit, repetition.py) is a 400 now rather than a 500 once the answer reaches it.
        if matcher.is_error() or not matcher.consume_tokens(forced) or matcher.is_error():
            why = (matcher.get_error() or "a forced token was refused").splitlines()[0]
            return GrammarOutcome(f"its forced start cannot be walked: {why}", [], b"")
        if (why := _first_token_error(matcher, self.tokenizer.vocab_size)) is not None:
            return GrammarOutcome(f"its first free token passes a limit of the grammar engine: {why}", [], b"")
        if self.keep is not None and pristine is not None:
            self.keep(constraint, pristine)
        return GrammarOutcome("", forced, start_mask, may_end)


def without_backtrace(error: str) -> str:
    """llguidance's error without the backtrace it appends to a panic (`<backtrace>` and a line per frame, each
    `<unknown>` in its stripped build)."""
    return error.split("\n<backtrace>", 1)[0]


PROBED_FIRST_TOKENS = 8  # allowed first tokens tried on copies of a fresh matcher (~0.2 ms each)


def _first_token_error(matcher: llguidance.LLMatcher, vocab_size: int) -> str | None:
    """The error of llguidance taking one of the first tokens its mask allows (after the forced start), if any: an
    object of ~600+ optional properties compiles, but its first property token passes the parser's row limit
    ("Current row has 2407 items; max is 2000"), which failed the row once sampling reached it (a 500 mid-answer);
    it is a 400 at admission now. Every token the mask allows is taken unless a limit stops it."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[:vocab_size]
    for token_id in np.flatnonzero(bits)[:PROBED_FIRST_TOKENS].tolist():
        probe = matcher.deep_copy()
        probe.consume_token(token_id)
        if probe.is_error():
            return (probe.get_error() or "").splitlines()[0]
    return None


def ending_ids(params: SamplingParams, eos_token_ids: set[int] | frozenset[int]) -> set[int]:
    """The ids that would end a completion at once: its stop_token_ids, and the EOS ids unless it ignores them
    (a forced start stops before one)."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))


def fast_forward_tokens(forced: list[int], params: SamplingParams, num_prompt_tokens: int, max_model_len: int,
                        max_num_tokens: int, stop_ids: set[int], vocab_size: int | None = None) -> list[int]:
    """The forced start of a constrained completion that joins its prompt's prefill as output tokens already
    generated (llguidance's fast-forward): the steps that could only have produced these tokens one by one are
    skipped. Empty where it does not apply: the grammar starts after reasoning, several completions or beams
    (they would fork from a longer prefix), logprobs (a forced token has none), a bias, a ban, bad words or an
    allow-list that might refuse a forced id. Cut before a stop or EOS id, before an id the model has no logit for
    (`vocab_size`: the tokenizer process's grammar has the tokenizer's width, which can exceed the model's; the
    worker's grammar spells that text with the model's ids), and so that a sampled token still fits after them
    (max_tokens, the context, the KV cache)."""
    constraint = params.structured_outputs
    if (not forced or constraint is None or constraint.reasoning_end or params.n != 1 or params.use_beam_search
            or params.logprobs is not None or params.logit_bias or params.allowed_token_ids or params.bad_words):
        return []
    room = min(max_model_len, max_num_tokens) - num_prompt_tokens - 1
    if params.max_tokens is not None:
        room = min(room, params.max_tokens - 1)
    kept: list[int] = []
    for token_id in forced[:max(room, 0)]:
        if token_id in stop_ids or (vocab_size is not None and token_id >= vocab_size):
            break
        kept.append(token_id)
    return kept


class LazyGrammarChecker:
    """A GrammarChecker for the tokenizer process, or the reason there is none. llguidance's tokenizer is built
    at construction, before the process serves: the build holds the GIL for seconds at a time on a loaded CPU
    (tokenizers' to_str, llguidance's Rust constructor), and on a background thread it starved the process's
    loop of its heartbeats until the scheduler dropped it. Validity does not depend on the mask width, so the
    tokenizer's own vocabulary and EOS are used."""

    def __init__(self, tokenizer: Any | None) -> None:
        self._checker: GrammarChecker | None = None
        self._hf = tokenizer.hf if tokenizer is not None else None
        if self._hf is None:
            return
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        try:
            self._checker = GrammarChecker(ll_tokenizer(self._hf, tokenizer.vocab_size, eos))
        except Exception:
            log.exception("cannot build llguidance's tokenizer; structured outputs will be refused")

    def check(self, constraint: StructuredOutputs, allowed_token_ids: Sequence[int] | None = None) -> list[int]:
        """GrammarChecker.check: 400 unless it compiles (and allowed_token_ids can start it); the ids its grammar
        forces at its start."""
        if self._hf is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer", param=CONSTRAINT_PARAM)
        if self._checker is None:
            raise InvalidRequestError("structured outputs are unavailable: the grammar library could not load "
                                      "this tokenizer", param=CONSTRAINT_PARAM)
        return self._checker.check(constraint, allowed_token_ids)

    def compiles_slowly(self, constraint: StructuredOutputs) -> bool:
        """Whether checking this constraint would compile a large grammar (its text at least
        SLOW_COMPILE_MIN_BYTES, not remembered): seconds of CPU for the largest, which the caller keeps off its
        loop by calling `prepare` on a thread first."""
        return (self._checker is not None and len(cache_key(constraint)) >= SLOW_COMPILE_MIN_BYTES
                and not self._checker.cached(constraint))

    def prepare(self, constraint: StructuredOutputs) -> None:
        """Compile the constraint into the cache (any thread); check then finds it there."""
        if self._checker is not None:
            self._checker.outcome(constraint)
