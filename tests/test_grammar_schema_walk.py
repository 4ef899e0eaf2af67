"""The one JSON-schema walk (shared/schema_walk.py) as its two users see it: local $refs rebased under a
new pointer (tools.rebase_refs) and numeric bounds checked (compiler.check_schema), data left alone by both."""

from __future__ import annotations

import pytest

from pagoda.services.grammar.compiler import check_schema
from pagoda.services.protocol.tools import rebase_refs
from pagoda.shared.errors import InvalidRequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "enum": {"$ref": "#/$defs/a"},  # a property named like a data keyword is a schema
        "b": {"anyOf": [{"$ref": "#"}, {"items": {"$ref": "#/definitions/c"}}]},
        "c": {"const": {"$ref": "#/x"}, "default": {"$ref": "#/y"}},  # data: stays as written
        "d": {"$ref": "https://example.com/s.json"},  # not local
    },
    "$defs": {"a": {"type": "integer", "maximum": 5}},
}


def test_rebase_refs_rewrites_local_refs_in_schemas_only() -> None:
    moved = rebase_refs(SCHEMA, "/anyOf/1")
    props = moved["properties"]
    assert props["enum"] == {"$ref": "#/anyOf/1/$defs/a"}
    assert props["b"]["anyOf"] == [{"$ref": "#/anyOf/1"}, {"items": {"$ref": "#/anyOf/1/definitions/c"}}]
    assert props["c"] == SCHEMA["properties"]["c"] and props["d"] == SCHEMA["properties"]["d"]
    assert moved["$defs"] == SCHEMA["$defs"]
    assert rebase_refs({"$id": "own", "$ref": "#/a"}, "/p") == {"$id": "own", "$ref": "#/a"}


@pytest.mark.parametrize(("schema", "pointer"), [
    ({"properties": {"minimum": {"type": "number", "minimum": -2**60}}}, "/properties/minimum/minimum"),
    ({"anyOf": [{}, {"items": {"exclusiveMaximum": -1e20}}]}, "/anyOf/1/items/exclusiveMaximum"),
    ({"$defs": {"x": {"maximum": -1e300}}}, "/$defs/x/maximum"),
])
def test_check_schema_names_the_bound_where_it_is(schema: dict, pointer: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_schema(schema)
    assert f"at {pointer} " in info.value.message


def test_check_schema_leaves_data_and_exact_bounds_alone() -> None:
    check_schema({"const": {"minimum": 1e300}, "enum": [{"maximum": -1e300}], "maximum": 2**63 - 1, "minimum": -5})
