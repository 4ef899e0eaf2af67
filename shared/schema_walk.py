"""One walk over a JSON schema's keywords, at every depth, for the passes that read or rewrite them (numeric bounds and
patterns checked in services/grammar/compiler.py, local $refs rebased in services/protocol/tools.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # JSON values, not schemas: never walked into
# keywords whose values map names to schemas: a property named "enum" or "$ref" is a schema, not the keyword
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})

# visit(keyword, value, pointer of the value) -> the keyword's value in the result
Visit = Callable[[str, Any, str], Any]


def map_keywords(node: Any, visit: Visit, pointer: str = "") -> Any:
    """A copy of a schema (or a list of them) with each keyword's value, at every depth, replaced by what
    visit(keyword, value, pointer) returns. A value visit returns as it came (the same object) is walked in turn,
    unless it is data (DATA_KEYWORDS); a replaced one is kept as visit made it."""
    if isinstance(node, list):
        return [map_keywords(item, visit, f"{pointer}/{i}") for i, item in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        at = f"{pointer}/{key}"
        new = visit(key, value, at)
        if new is not value or key in DATA_KEYWORDS:
            out[key] = new
        elif key in NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: map_keywords(sub, visit, f"{at}/{name}") for name, sub in value.items()}
        else:
            out[key] = map_keywords(value, visit, at)
    return out


def visit_keywords(node: Any, check: Callable[[str, Any, str], None]) -> None:
    """check(keyword, value, pointer) for each keyword of a schema at every depth (data keywords' values not
    walked into); check raises to refuse the schema."""

    def visit(key: str, value: Any, at: str) -> Any:
        check(key, value, at)
        return value

    map_keywords(node, visit)
