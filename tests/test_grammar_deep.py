"""Grammars that llguidance builds by deep recursion: a JSON schema of $refs that each reach the next (or a Lark chain
of rules that each name the next). On a thread's usual 8 MB of stack ~1,000 such $refs (some 60 KB of request)
overflowed it, and the process that compiled them died of SIGSEGV: the tokenizer's at admission, which stopped the
whole server. Each case runs in a child process, so that a regression fails the test, not the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pagoda.shared.messages import StructuredOutputs

REFS = 2000  # a $ref chain this long overflowed 8 MB (1,000 did)


def ref_chain(num_refs: int) -> dict[str, Any]:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(num_refs)}
    return {"$defs": {**defs, f"d{num_refs}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


CHILD = """
import sys, msgspec
from pagoda.services.grammar.compiler import GrammarChecker, load_ll_tokenizer
from pagoda.services.worker.grammar import GrammarRows
from pagoda.shared.messages import StructuredOutputs
folder, constraint = sys.argv[1], msgspec.json.decode(sys.stdin.buffer.read(), type=StructuredOutputs)
ll = load_ll_tokenizer(folder, 49152, [2])
print("forced", len(GrammarChecker(ll).check(constraint)), flush=True)  # the tokenizer process's admission check
matcher = GrammarRows._build(ll, constraint)  # the worker's compile
print("worker", matcher.is_error(), flush=True)
"""


@pytest.mark.parametrize("constraint", [StructuredOutputs(json=ref_chain(REFS)),
                                        StructuredOutputs(grammar=f"start: %json {json.dumps(ref_chain(REFS))}")],
                         ids=["json", "lark's %json"])
def test_a_deeply_recursive_grammar_compiles_without_overflowing_the_stack(smollm2_dir: Path,
                                                                         constraint: StructuredOutputs) -> None:
    child = subprocess.run([sys.executable, "-c", CHILD, str(smollm2_dir)], input=msgspec.json.encode(constraint),
                           capture_output=True, timeout=600)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert b"worker False" in child.stdout, child.stdout


ERROR_CHILD = """
import sys, msgspec
from pagoda.services.grammar.compiler import GrammarChecker, load_ll_tokenizer
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import StructuredOutputs
folder, constraint = sys.argv[1], msgspec.json.decode(sys.stdin.buffer.read(), type=StructuredOutputs)
try:
    GrammarChecker(load_ll_tokenizer(folder, 49152, [2])).check(constraint)
except InvalidRequestError as exc:
    print(exc.message, end="")
"""


def test_a_panic_in_the_grammar_engine_is_a_400_without_its_backtrace(smollm2_dir: Path) -> None:
    """An 8,000-$ref chain passes an assertion of llguidance's (its grammar's symbols must fit 16 bits), which it
    reports as a panic with a backtrace of `<unknown>` frames: the 400 says what failed, without them."""
    child = subprocess.run([sys.executable, "-c", ERROR_CHILD, str(smollm2_dir)],
                           input=msgspec.json.encode(StructuredOutputs(json=ref_chain(8000))), capture_output=True,
                           timeout=600)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    message = child.stdout.decode()
    assert message.startswith("the json constraint cannot be compiled: panic: assertion failed"), message
    assert "backtrace" not in message and "<unknown>" not in message and "\n" not in message, message
