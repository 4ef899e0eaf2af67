"""A constrained row's invariant on the worker: its matcher has consumed exactly the row's output tokens (the grammar's
forced start, then each sampled token once), so its mask is the grammar's after the text the client is shown. Where
the matcher cannot keep that (a token consumed twice or refused, a grammar that does not build), the row fails with
an error (take_failures, a 500), never samples without its mask, and never restarts its grammar mid-answer."""

from __future__ import annotations

from concurrent.futures import Future

import llguidance
import pytest

from pagoda.services.grammar.compiler import GrammarChecker
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.services.worker.grammar import MATCHER_LOST, GrammarMasks, GrammarRows
from pagoda.shared.messages import NewRequest, SamplingParams, StepPlan, StructuredOutputs

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}
CONSTRAINT = StructuredOutputs(json=CITY)
PROMPT = [1, 2]


@pytest.fixture(scope="module")
def forced(ll: llguidance.LLTokenizer, tokenizer: Tokenizer) -> list[int]:
    start = GrammarChecker(ll).check(CONSTRAINT)
    assert tokenizer.decode(start) == '{"city": "'  # several tokens: one lost or doubled shows
    return start


def new_request(seq_id: int, output_ids: list[int]) -> NewRequest:
    """The scheduler's NewRequest of a row whose output so far is output_ids (the forced start first)."""
    params = SamplingParams(structured_outputs=CONSTRAINT)
    return NewRequest(seq_id, PROMPT + output_ids, len(PROMPT), [0], 0, params, 0)


def mask_after(ll: llguidance.LLTokenizer, vocab_size: int, output_ids: list[int]) -> list[list[int]]:
    """The grammar's mask after output_ids, from a row that was given them all at admission."""
    rows = GrammarRows(lambda: ll, vocab_size)
    rows.apply(StepPlan(0, [], [], new_requests=[new_request(1, output_ids)]))
    masks = rows.bitmask([1])
    assert masks is not None and not rows.take_failures()
    return masks[1].tolist()


def masked(masks: GrammarMasks | None) -> list[list[int]]:
    assert masks is not None and masks[0].tolist() == [True]
    return masks[1].tolist()


class CompileEndsBetweenLooks(Future):
    """A compile that is still running at the first look and done at the next (the compile thread finishing while
    accept() looks at the row)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        super().__init__()
        self.set_result(matcher)
        self.looks = 0

    def done(self) -> bool:
        self.looks += 1
        return self.looks > 1


def test_a_token_sampled_while_the_grammar_compiles_is_consumed_once(
        ll: llguidance.LLTokenizer, tokenizer: Tokenizer, forced: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    paris = tokenizer.encode("Paris", add_special_tokens=False)
    assert len(paris) == 1
    expected = mask_after(ll, tokenizer.vocab_size, forced + paris)
    rows = GrammarRows(lambda: ll, tokenizer.vocab_size)
    late = CompileEndsBetweenLooks(GrammarRows._build(ll, CONSTRAINT))
    monkeypatch.setattr(rows, "_compile", lambda constraint: late)
    rows.apply(StepPlan(0, [], [], new_requests=[new_request(1, forced)]))
    rows.accept([1], paris)  # the compile ends while accept() looks: "Paris" must not reach the matcher twice
    assert masked(rows.bitmask([1])) == expected
    assert not rows.take_failures()


def test_the_forced_start_survives_a_recompute(ll: llguidance.LLTokenizer, tokenizer: Tokenizer,
                                               forced: list[int]) -> None:
    """Preempted and admitted again (its NewRequest carries forced + sampled), or a prefix-cache hit on them: the new
    matcher replays exactly those tokens."""
    paris = tokenizer.encode("Paris", add_special_tokens=False)
    rows = GrammarRows(lambda: ll, tokenizer.vocab_size)
    rows.apply(StepPlan(0, [], [], new_requests=[new_request(1, forced)]))
    assert masked(rows.bitmask([1])) == mask_after(ll, tokenizer.vocab_size, forced)
    rows.accept([1], paris)
    rows.apply(StepPlan(1, [], [], finished_seq_ids=[1], new_requests=[new_request(1, forced + paris)]))
    assert masked(rows.bitmask([1])) == mask_after(ll, tokenizer.vocab_size, forced + paris)
    assert not rows.take_failures()


def test_a_token_the_grammar_refuses_fails_the_row(ll: llguidance.LLTokenizer, tokenizer: Tokenizer,
                                                   forced: list[int]) -> None:
    """A token outside the matcher's state (a forced start applied twice, tokens the matcher lost) means the text and
    the matcher disagree: the row ends with an error, not with a stop that leaves its JSON open."""
    rows = GrammarRows(lambda: ll, tokenizer.vocab_size)
    rows.apply(StepPlan(0, [], [], new_requests=[new_request(1, forced)]))
    assert rows.bitmask([1]) is not None
    rows.accept([1], forced[:1])  # the forced start's first token again
    [(seq_id, why)] = rows.take_failures()
    assert seq_id == 1 and why.startswith(MATCHER_LOST) and "outside its grammar" in why
    assert rows.bitmask([1]) is None  # never masked (nor sampled) again; the runner drops it


def test_a_grammar_that_does_not_build_fails_the_row(ll: llguidance.LLTokenizer, tokenizer: Tokenizer,
                                                     forced: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """No matcher for the row: it fails, rather than sampling unmasked and, on its next token, compiling a fresh
    matcher that would restart the grammar after the forced start (`{"city": "{"city": ...`)."""

    def broken(ll_tok: llguidance.LLTokenizer, constraint: StructuredOutputs) -> llguidance.LLMatcher:
        raise RuntimeError("no matcher")

    monkeypatch.setattr(GrammarRows, "_build", staticmethod(broken))
    rows = GrammarRows(lambda: ll, tokenizer.vocab_size)
    rows.apply(StepPlan(0, [], [], new_requests=[new_request(1, forced)]))
    assert rows.bitmask([1]) is None
    [(seq_id, why)] = rows.take_failures()
    assert seq_id == 1 and why.startswith(MATCHER_LOST) and "no matcher" in why
    rows.accept([1], forced[:1])
    seq = rows._seqs[1]
    assert seq.compiling is None and seq.matcher is None and seq.failed  # no restart


def test_a_grammar_that_builds_in_error_fails_the_row(ll: llguidance.LLTokenizer, tokenizer: Tokenizer,
                                                      forced: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A matcher in error allows only EOS: the row would stop at once after its forced start. It fails instead."""
    monkeypatch.setattr(GrammarRows, "_build", staticmethod(
        lambda ll_tok, constraint: llguidance.LLMatcher(ll_tok, "start: ::: x", log_level=0)))
    rows = GrammarRows(lambda: ll, tokenizer.vocab_size)
    rows.apply(StepPlan(0, [], [], new_requests=[new_request(1, forced)]))
    assert rows.bitmask([1]) is None
    [(seq_id, why)] = rows.take_failures()
    assert seq_id == 1 and why.startswith(MATCHER_LOST) and "did not build" in why


# A regex whose lexer runs out of room mid-answer: llguidance then errors while it computes the mask ("lexer error:
# too many expressions constructed"), and the mask it leaves allows only EOS. Its lexer is shared by every copy of
# the pristine matcher, so a later row of the same constraint errors at its first mask.
LEXER_HUNGRY = StructuredOutputs(regex="(a|b|c|[a-z]{3,9}|[0-9]+x){1,200}")


def test_a_mask_the_grammar_engine_fails_to_compute_fails_the_row(ll: llguidance.LLTokenizer,
                                                                  tokenizer: Tokenizer) -> None:
    """A matcher that errors while computing its mask allows only EOS: sampled, the answer stopped there, ''
    or a word short of what the regex needs, with finish_reason stop. The row fails instead, and a later request
    of the same constraint gets a matcher of its own rather than the exhausted one."""
    words = tokenizer.encode("abcdefghijklmnopqrstuvwxyz" * 4, add_special_tokens=False)
    rows = GrammarRows(lambda: ll, tokenizer.vocab_size)
    params = SamplingParams(structured_outputs=LEXER_HUNGRY)
    rows.apply(StepPlan(0, [], [], new_requests=[NewRequest(1, PROMPT, len(PROMPT), [0], 0, params, 0)]))
    failures: list[tuple[int, str]] = []
    for token_id in words:
        assert rows.bitmask([1]) is not None
        failures = rows.take_failures()
        if failures:
            break
        rows.accept([1], [token_id])
    [(seq_id, why)] = failures
    assert seq_id == 1 and why.startswith(MATCHER_LOST) and "too many expressions" in why
    rows.apply(StepPlan(1, [], [], finished_seq_ids=[1],
                        new_requests=[NewRequest(2, PROMPT, len(PROMPT), [0], 0, params, 0)]))
    masks = masked(rows.bitmask([2]))
    assert not rows.take_failures()
    eos = tokenizer.eos_token_id
    assert not masks[0][eos // 32] >> (eos % 32) & 1  # a fresh matcher: a letter first, not EOS
