"""Structured outputs: grammar compile and cache, per-sequence matchers, and the whole server through the openai
client (json_schema, guided_choice / regex, parse with pydantic, errors, preemption). The bitmask application
is tested in tests/test_grammar_bitmask.py (no server dependencies there).

Every server test is deterministic by construction: each grammar bounds its output well inside max_tokens
(strings by a pattern of at most N ASCII characters, so at most N tokens; numbers by bounds and multipleOf;
arrays by maxItems; regexes by fixed counts), so no outcome depends on the small model choosing to finish."""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

import httpx
import llguidance
import msgspec
import pytest
import torch

from pagoda.services.grammar.compiler import GrammarChecker, constrain_after_reasoning, grammar_text
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.services.worker.grammar import GrammarRows
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import NewRequest, SamplingParams, StepPlan, StructuredOutputs
from tests.harness import SERVED, Server, running_server, wait_until

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

# --------------------------------------------------------------------------------------------
# compile and matchers with SmolLM2's tokenizer


@pytest.mark.parametrize("constraint", [
    StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 2}},
                            "required": ["a"]}),
    StructuredOutputs(json={"type": "object", "properties": {"a": {"$ref": "#/definitions/nope"}}}),
    StructuredOutputs(json={"type": "nonsense"}),
    StructuredOutputs(regex="(unclosed"),
    StructuredOutputs(regex="\\"),  # a lone backslash: llguidance took it for the empty regex (200, no text)
    StructuredOutputs(regex="ab\\\\\\"),  # an escaped backslash, then a lone one
    StructuredOutputs(grammar="start: undefined_rule"),
])
def test_rejected_grammars_raise_invalid_request(ll: llguidance.LLTokenizer, constraint: StructuredOutputs) -> None:
    checker = GrammarChecker(ll)
    for _ in range(2):  # the cached outcome too
        with pytest.raises(InvalidRequestError) as info:
            checker.check(constraint)
        assert "cannot be compiled" in info.value.message and info.value.param


def test_compile_is_cached_per_constraint(ll: llguidance.LLTokenizer) -> None:
    checker = GrammarChecker(ll, max_entries=2)
    a, b, c = (StructuredOutputs(regex=r) for r in ("a+", "b+", "c+"))
    checker.check(a)
    checker.check(b)
    checker.check(a)  # a is now the most recent
    checker.check(c)  # evicts b
    assert set(checker._outcomes) == {m for m in map(_key, (a, c))}


def _key(constraint: StructuredOutputs) -> bytes:
    from pagoda.services.grammar.compiler import cache_key
    return cache_key(constraint)


def test_choice_grammar_matches_only_the_choices(ll: llguidance.LLTokenizer, tokenizer: Tokenizer) -> None:
    grammar = grammar_text(StructuredOutputs(choice=['say "hi"', "a|b"]))
    for text, ok in [('say "hi"', True), ("a|b", True), ("a", False), ("say hi", False)]:
        matcher = llguidance.LLMatcher(ll, grammar)
        consumed = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
        assert (consumed and matcher.is_accepting()) == ok, text


def test_allowed_token_ids_must_be_able_to_start_the_grammar(ll: llguidance.LLTokenizer,
                                                              tokenizer: Tokenizer) -> None:
    """An allow-list that holds a token the grammar may start with passes (the forced first token of a grammar
    with one choice too); one that holds none is a 400 naming allowed_token_ids; no allow-list is no check."""
    checker = GrammarChecker(ll)
    choice = StructuredOutputs(choice=["red", "blue"])
    red, blue = (tokenizer.encode(word, add_special_tokens=False)[0] for word in ("red", "blue"))
    assert checker.check(choice, [red]) == [] and checker.check(choice, [3, blue]) == []
    assert checker.check(StructuredOutputs(choice=["red"]), [red]) == [red]  # forced, and allowed
    for allowed in ([5, 6, 7], [10 ** 9], [tokenizer.eos_token_id]):
        with pytest.raises(InvalidRequestError, match="allowed_token_ids") as raised:
            checker.check(choice, allowed)
        assert raised.value.param == "allowed_token_ids"
    assert checker.check(choice, None) == [] and checker.check(choice, []) == []
    # a grammar that accepts the empty output may end at once: any list passes (the worker lets its EOS through)
    assert checker.check(StructuredOutputs(regex="(ab)?"), [5, 6, 7]) == []


def test_gbnf_grammar_compiles_and_matches(ll: llguidance.LLTokenizer, tokenizer: Tokenizer) -> None:
    # vLLM's clients send GBNF (llama.cpp's, as xgrammar takes it); every one was refused before: "'module' object
    # is not callable" (llguidance.gbnf_to_lark is a module)
    gbnf = StructuredOutputs(grammar='root ::= color ("," color)*\ncolor ::= "red" | "blue"')
    GrammarChecker(ll).check(gbnf)
    grammar = grammar_text(gbnf)
    for text, ok in [("red", True), ("blue,red", True), ("green", False), ("red,", False)]:
        matcher = llguidance.LLMatcher(ll, grammar)
        consumed = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
        assert (consumed and matcher.is_accepting()) == ok, text


def test_regex_shorthand_classes_are_ascii_as_in_json_schema(ll: llguidance.LLTokenizer,
                                                              tokenizer: Tokenizer) -> None:
    """\\d \\w \\s in a regex constraint mean what they mean in a JSON Schema pattern (ECMAScript: ASCII), as with
    vLLM's default backend: Kannada digits no longer pass for \\d. Escaped backslashes and other escapes stay."""
    from pagoda.services.grammar.compiler import ascii_shorthands

    assert ascii_shorthands(r"\d{3}-[\w.]\\d\p{L}") == r"[0-9]{3}-[[0-9A-Za-z_].]\\d\p{L}"

    def accepts(regex: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(ll, grammar_text(StructuredOutputs(regex=regex)))
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    cases = [(r"\d{3}-\d{4}", "555-0134", True), (r"\d{3}", "\u0ce7\u0cea\u0ce7", False),
             (r"[^\d]+", "abc", True), (r"[^\d]+", "a1", False), (r"\w+", "snake_case9", True),
             (r"\w+", "caf\u00e9", False), (r"a\sb", "a b", True), (r"a\sb", "a\u3000b", False),
             (r"\\d", "\\d", True)]
    for regex, text, ok in cases:
        assert accepts(regex, text) == ok, (regex, text)
    for regex, text, ok in cases[:2]:  # a JSON Schema pattern, for comparison: the same answers
        matcher = llguidance.LLMatcher(ll, grammar_text(StructuredOutputs(json={"type": "string",
                                                                             "pattern": "^" + regex + "$"})))
        consumed = matcher.consume_tokens(tokenizer.encode(json.dumps(text, ensure_ascii=False),
                                                           add_special_tokens=False))
        assert (consumed and matcher.is_accepting()) == ok, (regex, text)


def _rows(ll: llguidance.LLTokenizer, vocab: int) -> GrammarRows:
    return GrammarRows(lambda: ll, vocab)


def _new(seq_id: int, prompt: list[int], generated: list[int], constraint: StructuredOutputs | None) -> NewRequest:
    return NewRequest(seq_id, prompt + generated, len(prompt), [0], 0,
                      SamplingParams(structured_outputs=constraint), 0)


def test_a_row_left_without_a_token_fails_unsampled(ll: llguidance.LLTokenizer, tokenizer: Tokenizer) -> None:
    """allowed_token_ids that fit the grammar's start but not what must follow: the mask fill reports the row
    (take_failures, NO_TOKEN_LEFT) instead of letting it sample outside both; rows that keep a token do not."""
    from pagoda.services.worker.grammar import NO_TOKEN_LEFT

    r = tokenizer.encode("r", add_special_tokens=False)
    assert len(r) == 1
    choice = StructuredOutputs(choice=["red", "blue"])
    rows = _rows(ll, tokenizer.vocab_size)
    narrow = msgspec.structs.replace(_new(3, [1, 2], [], choice),
                                     sampling=SamplingParams(structured_outputs=choice, allowed_token_ids=r))
    wide = msgspec.structs.replace(_new(4, [1, 2], [], choice), sampling=SamplingParams(
        structured_outputs=choice, allowed_token_ids=r + tokenizer.encode("ed", add_special_tokens=False)))
    rows.apply(StepPlan(0, [], [], new_requests=[narrow, wide]))
    first = rows.bitmask([3, 4])
    assert first is not None and _allowed(first[1][0], r[0]) and rows.take_failures() == []
    rows.accept([3, 4], [r[0], r[0]])
    assert rows.bitmask([3, 4]) is not None
    assert rows.take_failures() == [(3, NO_TOKEN_LEFT)]  # "r" must go on with "ed", which only 4 allows
    assert rows.take_failures() == []
    # a grammar that must end: its EOS gets through an allow-list without it (the completion ends, no failure)
    red = tokenizer.encode("red", add_special_tokens=False)
    done = msgspec.structs.replace(_new(5, [1, 2], [], choice), sampling=SamplingParams(
        structured_outputs=StructuredOutputs(choice=["red"]), allowed_token_ids=red))
    rows.apply(StepPlan(1, [], [], new_requests=[done]))
    rows.accept([5], red)
    masks = rows.bitmask([5])
    assert masks is not None and rows.take_failures() == []
    assert [t for t in range(tokenizer.vocab_size) if _allowed(masks[1][0], t)] == [tokenizer.eos_token_id]


def test_bad_words_narrow_a_grammar_row_and_fail_it_when_they_ban_all_it_allows(ll: llguidance.LLTokenizer,
                                                                               tokenizer: Tokenizer) -> None:
    """bad_words on a grammar row: the mask leaves out what the sampler bans this step (a one-token word always, a
    longer one after its other tokens, also after a recompute), and a row whose words ban every token its grammar
    allows fails (take_failures, NO_WORD_LEFT: a 400 naming bad_words) instead of sampling outside the grammar."""
    from pagoda.services.worker.grammar import NO_WORD_LEFT, row_failure

    vocab = tokenizer.vocab_size
    cities = StructuredOutputs(choice=["Paris, France", "Lyon"])
    first = tokenizer.encode("Paris, France", add_special_tokens=False)[0]

    def with_words(seq_id: int, words: list[list[int]], generated: list[int] = ()) -> NewRequest:  # type: ignore
        return msgspec.structs.replace(_new(seq_id, [1, 2], list(generated), cities), sampling=SamplingParams(
            structured_outputs=cities, bad_words=["w"] * len(words), bad_words_token_ids=words))

    def allowed_ids(rows: GrammarRows, seq_id: int) -> set[int]:
        masks = rows.bitmask([seq_id])
        assert masks is not None
        return {t for t in range(vocab) if _allowed(masks[1][0], t)}

    free = _rows(ll, vocab)
    free.apply(StepPlan(0, [], [], new_requests=[_new(1, [1, 2], [], cities), _new(2, [1, 2], [first], cities)]))
    starts, after = allowed_ids(free, 1), allowed_ids(free, 2)  # the grammar's own first and second masks
    assert first in starts and len(starts) > 1 and after and free.take_failures() == []
    rows = _rows(ll, vocab)
    rows.apply(StepPlan(0, [], [], new_requests=[
        with_words(3, [[first]]),  # one token: never allowed, the grammar's other start stays
        with_words(4, [[t] for t in starts]),  # every token that can start: no token left
        with_words(5, [[first, t] for t in after]),  # "Paris" then anything that goes on: fails after "Paris"
        with_words(6, [[first, t] for t in after], generated=[first])]))  # the same, recomputed after "Paris"
    assert allowed_ids(rows, 3) == starts - {first} and rows.take_failures() == []
    assert rows.bitmask([4]) is not None and rows.take_failures() == [(4, NO_WORD_LEFT)]
    assert allowed_ids(rows, 5) == starts and rows.take_failures() == []
    rows.accept([5], [first])
    assert rows.bitmask([5, 6]) is not None and rows.take_failures() == [(5, NO_WORD_LEFT), (6, NO_WORD_LEFT)]
    failure = row_failure(4, NO_WORD_LEFT)
    assert failure.status == 400 and failure.param == "bad_words"


def test_recomputed_sequence_gets_the_same_mask_as_one_that_never_left(ll: llguidance.LLTokenizer,
                                                                       tokenizer: Tokenizer) -> None:
    constraint = StructuredOutputs(json={"type": "object", "properties": {"name": {"type": "string"}},
                                         "required": ["name"]})
    text_ids = tokenizer.encode('{"name": "Bo', add_special_tokens=False)
    vocab = tokenizer.vocab_size
    running = _rows(ll, vocab)
    running.apply(StepPlan(0, [], [], new_requests=[_new(7, [1, 2], [], constraint),
                                                    _new(8, [1, 2], [], None)]))
    for token_id in text_ids:
        mask = running.bitmask([8, 7])
        assert mask is not None and mask[0].tolist() == [False, True]  # only row 1 (request 7) is constrained
        assert mask[2].tolist() == [1]  # ... and only its mask is filled (and copied): compact, [K, W]
        assert mask[1].shape == (1, -(-vocab // 32)) and _allowed(mask[1][0], token_id)
        running.accept([8, 7], [5, token_id])
    # preempted and recomputed: a new NewRequest carries the tokens generated so far
    recomputed = _rows(ll, vocab)
    recomputed.apply(StepPlan(0, [], [], new_requests=[_new(7, [1, 2], text_ids, constraint)]))
    first, second = running.bitmask([7]), recomputed.bitmask([7])
    assert first is not None and second is not None and torch.equal(first[1][0], second[1][0])
    # finished or preempted: dropped
    running.apply(StepPlan(1, [], [], finished_seq_ids=[7]))
    assert running.bitmask([7, 8]) is None


def _is_prefix(ll: llguidance.LLTokenizer, tokenizer: Tokenizer, constraint: StructuredOutputs, text: str) -> bool:
    """The text is what the grammar allows so far (whole or cut short)."""
    return llguidance.LLMatcher(ll, grammar_text(constraint)).consume_tokens(
        tokenizer.encode(text, add_special_tokens=False))


def _allowed(words: torch.Tensor, token_id: int) -> bool:
    return bool((int(words[token_id // 32]) >> (token_id % 32)) & 1)


def test_thread_pool_fills_and_advances_like_one_thread(ll: llguidance.LLTokenizer, tokenizer: Tokenizer,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU machine's path (many rows, many CPUs: llguidance's pool) against the serial one, on this machine."""
    from pagoda.services.worker import grammar
    constraints = [StructuredOutputs(json=SCHEMAS[0]), StructuredOutputs(regex="[0-9]{2}(, [0-9]{2}){9}"), None]
    texts = ['{"name": "Ann", "age": 3', "12, 34, 5", "free text"]
    seq_ids = list(range(12))
    tokens = [tokenizer.encode(texts[r % 3], add_special_tokens=False) for r in seq_ids]
    masks = []
    for parallel in (False, True):
        monkeypatch.setattr(grammar, "PARALLEL_ROWS", 1 if parallel else 10**6)
        monkeypatch.setattr(grammar, "PARALLEL_MIN_CPUS", 1)
        rows = _rows(ll, tokenizer.vocab_size)
        rows.apply(StepPlan(0, [], [], new_requests=[_new(r, [1], [], constraints[r % 3]) for r in seq_ids]))
        steps = []
        for position in range(min(map(len, tokens))):
            flags, mask, index = rows.bitmask(seq_ids) or (None, None, None)
            assert flags is not None and mask is not None and flags.tolist() == [r % 3 != 2 for r in seq_ids]
            assert index is not None and index.tolist() == [r for r in seq_ids if r % 3 != 2]
            steps.append(mask.clone())
            rows.accept(seq_ids, [t[position] for t in tokens])
        masks.append(torch.stack(steps))
    assert torch.equal(masks[0], masks[1])


def test_finished_grammar_allows_only_eos(ll: llguidance.LLTokenizer, tokenizer: Tokenizer) -> None:
    rows = _rows(ll, tokenizer.vocab_size)
    rows.apply(StepPlan(0, [], [], new_requests=[_new(1, [3], [], StructuredOutputs(choice=["yes"]))]))
    rows.accept([1], tokenizer.encode("yes", add_special_tokens=False))
    mask = rows.bitmask([1])
    assert mask is not None
    allowed = [t for t in range(tokenizer.vocab_size) if _allowed(mask[1][0], t)]
    assert allowed == [tokenizer.eos_token_id]


def test_allowed_token_ids_mask_alone_and_narrowing_a_grammar(ll: llguidance.LLTokenizer,
                                                              tokenizer: Tokenizer) -> None:
    """vLLM's allowed_token_ids ride the grammar bitmask: a row with them alone gets exactly those ids; with a
    grammar, the ids both allow; a row with neither stays unflagged; a finished request's mask is dropped."""
    yes, no = (tokenizer.encode(word, add_special_tokens=False)[0] for word in ("yes", "no"))
    allowed = [yes, 7, 40000, tokenizer.vocab_size - 1]
    only = NewRequest(1, [3], 1, [0], 0, SamplingParams(allowed_token_ids=allowed), 0)
    both = NewRequest(2, [3], 1, [0], 0, SamplingParams(allowed_token_ids=allowed, structured_outputs=StructuredOutputs(
        choice=["yes", "no"])), 0)
    rows = _rows(ll, tokenizer.vocab_size)
    rows.apply(StepPlan(0, [], [], new_requests=[only, both, _new(3, [3], [], None)]))
    assert rows.constrains([3, 1]) and not rows.constrains([3]) and not rows.has_matchers([1])
    result = rows.bitmask([1, 2, 3])
    assert result is not None
    flags, mask, index = result
    assert flags.tolist() == [True, True, False] and index.tolist() == [0, 1]  # compact: rows 0 and 1 only
    assert [t for t in range(tokenizer.vocab_size) if _allowed(mask[0], t)] == sorted(allowed)
    assert [t for t in range(tokenizer.vocab_size) if _allowed(mask[1], t)] == [yes]  # "no" is not allowed
    rows.apply(StepPlan(1, [], [], finished_seq_ids=[1, 2]))
    assert not rows.constrains([1, 2]) and rows.bitmask([1, 2, 3]) is None


def test_reasoning_models_are_constrained_after_think(ll: llguidance.LLTokenizer, tokenizer: Tokenizer) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputs(choice=["yes"]))
    assert constrain_after_reasoning(params, prompt_closed=True).structured_outputs.reasoning_end == ""
    params = constrain_after_reasoning(params, prompt_closed=False)
    rows = _rows(ll, tokenizer.vocab_size)
    rows.apply(StepPlan(0, [], [], new_requests=[NewRequest(1, [3], 1, [0], 0, params, 0)]))
    for token_id in tokenizer.encode("<think>I may say no</thi", add_special_tokens=False):
        assert rows.bitmask([1]) is None  # free while it reasons
        rows.accept([1], [token_id])
    for token_id in tokenizer.encode("nk>", add_special_tokens=False):
        rows.accept([1], [token_id])
    mask = rows.bitmask([1])
    assert mask is not None and not _allowed(mask[1][0], tokenizer.encode("no", add_special_tokens=False)[0])


def test_structured_outputs_validation() -> None:
    with pytest.raises(InvalidRequestError):
        StructuredOutputs(json={"type": "object"}, regex="a").validate()
    with pytest.raises(InvalidRequestError):
        StructuredOutputs().validate()
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputs(regex="a")).validate()
    assert info.value.param == "ignore_eos"


# --------------------------------------------------------------------------------------------
# the whole server

pytestmark_slow = pytest.mark.slow

def words(max_chars: int) -> dict[str, object]:
    """A JSON string of 1..max_chars ASCII letters and spaces: at most max_chars tokens (each token >= 1 byte)."""
    return {"type": "string", "pattern": f"^[A-Za-z ]{{1,{max_chars}}}$"}


# Each answer is at most ~70 bytes of JSON (so at most ~70 tokens) and ends with `stop` inside max_tokens=80.
SCHEMAS = [
    {"type": "object", "properties": {"name": words(16), "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": words(16),
                                      "location": {"type": "object", "properties": {
                                          "lat": {"type": "number", "minimum": -90, "maximum": 90,
                                                  "multipleOf": 0.25},
                                          "lon": {"type": "number", "minimum": -180, "maximum": 180,
                                                  "multipleOf": 0.25}},
                                          "required": ["lat", "lon"], "additionalProperties": False}},
     "required": ["city", "location"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": words(10), "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "mood": {"type": "string", "enum": ["happy", "sad"]}},
     "required": ["color", "mood"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5},
                                      "passed": {"type": "boolean"}, "note": words(20)},
     "required": ["score", "passed"], "additionalProperties": False},
]
FILLER = "Once upon a time in a quiet village by the sea, the fishermen told tales of storms and lights. " * 9
TOPICS = ["a cat", "Paris", "a bicycle", "the moon", "a teacher", "a river", "coffee", "a violin", "winter",
          "a robot", "the ocean", "a library", "football", "a volcano", "chess", "a garden", "a train", "music",
          "a desert", "a computer"]
KV_BLOCKS = 96


@pytest.fixture(scope="module")
def server(smollm2_dir: Path) -> Iterator[Server]:
    # A small KV cache (96 blocks of 16 tokens, 1536 tokens) so that a few concurrent requests preempt one another.
    with running_server(smollm2_dir, "--num-kv-blocks", str(KV_BLOCKS), "--max-num-seqs", "64") as running:
        yield running


def _chat(client: openai.OpenAI, content: str, **kwargs: object) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": content}],
                                          **kwargs)  # type: ignore[call-overload]


@pytest.mark.slow
@pytest.mark.parametrize("num_topics", [4, pytest.param(20, marks=pytest.mark.extended)])
def test_json_schema_answers_validate_for_each_of_5_schemas(server: Server, num_topics: int) -> None:
    """Every schema, several prompts each, all at once (20 concurrent constrained rows in one batch; they fit the 96
    blocks: two runs counted no preemption, which test_constrained_and_free_rows_in_one_batch_with_aborts forces and
    asserts); the 100-request run (20 prompts a schema) is the same property under more load (make test-all)."""
    client = server.client(timeout=900)
    jobs = [(schema, topic) for schema in SCHEMAS for topic in TOPICS[:num_topics]]

    def one(job: tuple[dict[str, object], str]) -> tuple[dict[str, object], str, str | None]:
        schema, topic = job
        response = _chat(client, f"Describe {topic} as JSON.", max_tokens=80, temperature=0.7, seed=1,
                         response_format={"type": "json_schema",
                                          "json_schema": {"name": "answer", "schema": schema, "strict": True}})
        choice = response.choices[0]
        return schema, choice.message.content or "", choice.finish_reason

    with concurrent.futures.ThreadPoolExecutor(min(len(jobs), 50)) as pool:
        results = list(pool.map(one, jobs))
    for schema, text, finish_reason in results:
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
def test_json_object_guided_choice_and_regex(server: Server, ll: llguidance.LLTokenizer,
                                             tokenizer: Tokenizer) -> None:
    client = server.client(timeout=600)
    choices = ["positive", "negative", "neutral"]
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    # the four requests are independent: sent at once (the engine batches them), each checked on its own below
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        dogs_job = pool.submit(_chat, client, "Give me a JSON object about dogs.", max_tokens=80,
                               response_format={"type": "json_object"})
        choice_job = pool.submit(_chat, client, "I love this!", n=3, max_tokens=10, temperature=1.0,
                                 extra_body={"guided_choice": choices})
        regex_job = pool.submit(client.completions.create, model=SERVED, prompt="My phone number is", max_tokens=20,
                                extra_body={"structured_outputs": {"regex": r"\d{3}-\d{3}-\d{4}"}})
        grammar_job = pool.submit(client.completions.create, model=SERVED, prompt="2+2?", max_tokens=20,
                                  extra_body={"guided_grammar": grammar})
    # json_object bounds nothing: the answer must be a valid JSON prefix, and a whole object when it stopped
    dogs = dogs_job.result().choices[0]
    text = dogs.message.content or ""
    assert text.startswith("{") and _is_prefix(ll, tokenizer, StructuredOutputs(json_object=True), text), text
    assert dogs.finish_reason == "length" or isinstance(json.loads(text), dict), (dogs.finish_reason, text)
    for n_choice in choice_job.result().choices:
        assert n_choice.message.content in choices and n_choice.finish_reason == "stop"
    completion = regex_job.result()
    assert re.fullmatch(r"\d{3}-\d{3}-\d{4}", completion.choices[0].text)
    text = grammar_job.result().choices[0].text
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", text)


Word = Annotated[str, pydantic.StringConstraints(pattern=r"^[A-Za-z ]{1,12}$")]


class Person(pydantic.BaseModel):
    """At most ~90 bytes of JSON: parse's answer always ends inside max_tokens=150."""

    name: Word
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["teacher", "doctor", "farmer"]
    hobbies: list[Word] = pydantic.Field(max_length=3)


@pytest.mark.slow
def test_openai_parse_with_a_pydantic_model(server: Server) -> None:
    client = server.client(timeout=600)
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    response = parse(model=SERVED, messages=[{"role": "user", "content": "Invent a person."}],
                     response_format=Person, max_tokens=150)
    choice = response.choices[0]
    person = choice.message.parsed
    assert choice.finish_reason == "stop"
    assert isinstance(person, Person) and 0 <= person.age <= 120 and len(person.hobbies) <= 3


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    # a grammar that does not compile is refused under the field the client sent (it was named response_format,
    # or guided_<kind>, whatever the field)
    ({"guided_json": {"type": "bogus"}}, "guided_json"),
    ({"structured_outputs": {"json": {"type": "bogus"}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " ", "disable_any_whitespace": True}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "structured_outputs"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
    # an allow-list with no token the grammar may start with: every sampled token broke the grammar (200 with
    # token 0 repeated to max_tokens)
    ({"guided_choice": ["red", "blue"], "allowed_token_ids": [5, 6, 7]}, "allowed_token_ids"),
])
def test_grammar_errors_are_400(server: Server, extra: dict[str, object], param: str) -> None:
    body = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


@pytest.mark.slow
def test_an_allow_list_that_runs_out_mid_grammar_is_a_400_and_the_server_serves_on(server: Server) -> None:
    """allowed_token_ids that can start the grammar but not finish it: the row fails when its mask empties (it
    sampled outside both before: token 0 to max_tokens), streamed or not; the next request is served."""
    r = httpx.post(server.url + "/tokenize", json={"model": SERVED, "prompt": "r", "add_special_tokens": False},
                   timeout=60).json()["tokens"]
    body = {"model": SERVED, "prompt": "Pick a colour:", "max_tokens": 5, "guided_choice": ["red", "blue"],
            "allowed_token_ids": r}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "allowed_token_ids leave no token" in error["message"] and error["param"] == "allowed_token_ids"
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert any("allowed_token_ids leave no token" in event for event in events), events
    ok = httpx.post(server.url + "/v1/completions", json={**body, "allowed_token_ids": None}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("red", "blue")


@pytest.mark.slow
def test_constrained_and_free_rows_in_one_batch_with_aborts(server: Server) -> None:
    client = server.client(timeout=900)
    schema = SCHEMAS[0]
    before = server.metrics()["pagoda_num_preemptions_total"]

    def constrained(i: int) -> str:
        response = _chat(client, f"Describe person {i} as JSON.", max_tokens=80, temperature=0.8, seed=i,
                         response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
        return response.choices[0].message.content or ""

    def free(i: int) -> str:
        # Preemption by construction, cheaply on a CPU: a ~230-token prompt (prefill is cheap) that differs from
        # its first words (no prefix hits), and 12 tokens with ignore_eos, need 16 blocks a row (past 240 tokens:
        # 24 tokens, as before, only cost 12 more decode steps of the whole batch); admission fills the 96 blocks
        # with prompt chunks (the 8 prompts alone need 120), so rows that grow preempt others (asserted below).
        prompt = f"Story {i}: " + FILLER + f" Continue this story about {TOPICS[i]}."
        return _chat(client, prompt, max_tokens=12, temperature=0.8, seed=i,
                     extra_body={"ignore_eos": True}).choices[0].message.content or ""

    def aborted(i: int) -> int:
        # the regex needs 398 characters, so the stream runs to max_tokens: it is cut by the client, not the model
        with client.chat.completions.create(model=SERVED, stream=True, max_tokens=200,
                                            messages=[{"role": "user", "content": f"Count to {i}"}],
                                            extra_body={"guided_regex": "[0-9]{2}(, [0-9]{2}){99}"}) as stream:
            for seen, _ in enumerate(stream):
                if seen >= 3:
                    return seen
        return -1

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        kept = [pool.submit(constrained, i) for i in range(8)]
        loose = [pool.submit(free, i) for i in range(8)]
        cut = [pool.submit(aborted, i) for i in range(4)]
        texts = [f.result() for f in kept]
        stories = [f.result() for f in loose]
        assert all(f.result() == 3 for f in cut)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert any(not story.lstrip().startswith("{") for story in stories)  # free rows stayed free
    assert server.metrics()["pagoda_num_preemptions_total"] > before
    wait_until(lambda: server.metrics().get("pagoda_num_requests_running", 0) == 0, 30, "aborted streams to end")
