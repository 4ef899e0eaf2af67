"""A grammar's forced start (llguidance's fast-forward tokens) joins the prompt's prefill as output tokens: which
requests get it (compiler.fast_forward_tokens), the scheduler's checks, the offline engine end to end on SmolLM2
(one step per sampled token, the forced tokens shown first, the answer valid), and the tokenizer service showing
the forced start with a completion's first token."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import msgspec
import pytest

from pagoda import LLM
from pagoda.services.grammar.compiler import GrammarChecker, fast_forward_tokens, ll_tokenizer
from pagoda.services.scheduler.scheduler import Request, Scheduler
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import FinishReason, SamplingParams, StructuredOutputs

SENTIMENT = {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
             "required": ["sentiment"], "additionalProperties": False}  # bounded: ends within max_tokens
FORCED_TEXT = '{"sentiment": "'  # what the schema fixes before the model's first choice


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def checker(tokenizer: Tokenizer) -> GrammarChecker:
    ll: llguidance.LLTokenizer = ll_tokenizer(tokenizer.hf, tokenizer.vocab_size, [tokenizer.eos_token_id])
    return GrammarChecker(ll)


def constrained(**fields: object) -> SamplingParams:
    settings: dict[str, object] = {"temperature": 0.0, "max_tokens": 16, **fields}
    return SamplingParams(structured_outputs=StructuredOutputs(json=SENTIMENT), **settings)  # type: ignore[arg-type]


def test_checker_returns_the_grammar_start(checker: GrammarChecker, tokenizer: Tokenizer) -> None:
    forced = checker.check(StructuredOutputs(json=SENTIMENT))
    assert tokenizer.decode(forced) == FORCED_TEXT
    assert checker.check(StructuredOutputs(json=SENTIMENT)) == forced  # the cached outcome
    assert checker.check(StructuredOutputs(json={"type": "object"})) == []  # '{' then a choice: '}' or a key


def test_which_requests_fast_forward() -> None:
    forced = [11, 12, 13, 14]
    assert fast_forward_tokens(forced, constrained(), 10, 100, 1000, set()) == forced
    for refused in (constrained(n=2), constrained(logprobs=0), constrained(logit_bias={5: 1.0}),
                    constrained(allowed_token_ids=[11, 12]), SamplingParams(max_tokens=16),
                    msgspec.structs.replace(constrained(), structured_outputs=StructuredOutputs(
                        json=SENTIMENT, reasoning_end="</think>"))):
        assert fast_forward_tokens(forced, refused, 10, 100, 1000, set()) == [], refused
    # a sampled token must still fit after them: max_tokens, the context, the KV cache
    assert fast_forward_tokens(forced, constrained(max_tokens=3), 10, 100, 1000, set()) == [11, 12]
    assert fast_forward_tokens(forced, constrained(), 10, 13, 1000, set()) == [11, 12]
    assert fast_forward_tokens(forced, constrained(), 10, 100, 12, set()) == [11]
    assert fast_forward_tokens(forced, constrained(max_tokens=1), 10, 100, 1000, set()) == []
    # they stop before an id that would end the completion
    assert fast_forward_tokens(forced, constrained(), 10, 100, 1000, {13}) == [11, 12]
    # an id past the model's logits (a tokenizer with more tokens than the model): the forced start ends before it
    assert fast_forward_tokens(forced, constrained(), 10, 100, 1000, set(), vocab_size=13) == [11, 12]


def test_scheduler_refuses_forced_tokens_that_do_not_fit() -> None:
    scheduler = Scheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=24,
                          vocab_size=100, seed=0)
    good = Request("a", [1, 2, 3], constrained(max_tokens=8), forced_token_ids=[4, 5])
    scheduler.check_prompt(good)
    scheduler.add_request(good)
    assert good.sequences[0].token_ids == [1, 2, 3, 4, 5] and good.sequences[0].num_prompt_tokens == 3
    assert good.sequences[0].num_output_tokens == 2
    for bad in (Request("b", [1, 2], constrained(n=2), forced_token_ids=[4]),
                Request("c", [1, 2], constrained(), forced_token_ids=[100]),
                Request("d", [1, 2], constrained(max_tokens=2), forced_token_ids=[4, 5]),
                Request("e", [1] * 20, constrained(max_tokens=None), forced_token_ids=[4] * 4)):
        with pytest.raises(InvalidRequestError) as info:
            scheduler.check_prompt(bad)
        assert info.value.param == "forced_token_ids", bad.request_id


def test_offline_engine_prefills_the_forced_start(smollm2_dir: Path, tokenizer: Tokenizer) -> None:
    prompts = ["Review: the food was wonderful and the staff kind. Sentiment as JSON:"]
    params = constrained()
    runs = {}
    for fast_forward in (True, False):
        llm = LLM(str(smollm2_dir), max_model_len=256, grammar_fast_forward=fast_forward)
        engine = llm.engine
        request_id = engine.add_request(prompts[0], params)
        deltas = []
        while engine.has_unfinished_requests():
            deltas += engine.step()
        output = engine.pop_output(request_id).outputs[0]
        runs[fast_forward] = (output, deltas, engine.scheduler.stats.num_steps)
    output, deltas, num_steps = runs[True]
    assert json.loads(output.text)["sentiment"] in SENTIMENT["properties"]["sentiment"]["enum"]
    assert output.text.startswith(FORCED_TEXT)
    assert "".join(d.text for d in deltas) == output.text
    assert [t for d in deltas for t in d.token_ids] == output.token_ids
    assert deltas[0].text.startswith(FORCED_TEXT)
    forced = GrammarChecker(llm.engine.runner.grammars.tokenizer()).check(StructuredOutputs(json=SENTIMENT))
    assert forced and tokenizer.decode(forced) == FORCED_TEXT
    assert output.token_ids[:len(forced)] == forced
    # one step per sampled token: the prefill samples the first, each later step one more
    assert num_steps == len(output.token_ids) - len(forced)
    plain, _, plain_steps = runs[False]
    assert json.loads(plain.text)["sentiment"] in SENTIMENT["properties"]["sentiment"]["enum"]
    assert plain_steps == len(plain.token_ids) > num_steps


@pytest.mark.parametrize("stop", ["iment", '{"', '": "'])
def test_a_stop_string_inside_the_forced_start_ends_the_answer_there(smollm2_dir: Path, stop: str) -> None:
    """A stop string the forced start completes ends the answer at the token that completes it, as sampling the
    start token by token does: its token ids and usage held the whole forced start and one sampled token past the
    stop ('{"' cut the text to '' and still counted six tokens, "positive" among them)."""
    params = constrained(stop=[stop])
    prompt = "Review: the food was wonderful and the staff kind. Sentiment as JSON:"
    outputs = [LLM(str(smollm2_dir), max_model_len=256, grammar_fast_forward=fast_forward).generate(
        [prompt], params)[0].outputs[0] for fast_forward in (True, False)]
    for output in outputs:
        assert (output.finish_reason, output.stop_reason) == ("stop", stop)
        assert output.text == FORCED_TEXT[:FORCED_TEXT.index(stop)]
    assert outputs[0].token_ids == outputs[1].token_ids


def test_cached_tokens_count_the_prompt_only(smollm2_dir: Path, tokenizer: Tokenizer) -> None:
    """The second of two equal constrained requests finds the first's blocks cached, the forced start's too: its
    num_cached_tokens (usage's cached_tokens) counts the prompt's hits only. The scheduler reported hits past the
    prompt (here 32 of 30 tokens) whenever the last hit block held forced tokens."""
    llm = LLM(str(smollm2_dir), max_model_len=256)
    ids = tokenizer.encode("Review: the food was wonderful and the staff kind. Sentiment as JSON:")
    block_size = llm.engine.scheduler.block_size
    prompt = (ids * 4)[:2 * block_size - 2]  # the forced start fills the second block: it is cached as a whole
    first, second = (llm.generate({"prompt_token_ids": prompt}, constrained())[0] for _ in range(2))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == len(prompt)  # two blocks hit: the whole prompt and two forced tokens


def test_tokenizer_service_sends_and_shows_the_forced_start(smollm2_dir: Path, tokenizer: Tokenizer) -> None:
    from tests.test_tokenizer_service import Harness, model_info

    harness = Harness(smollm2_dir)
    try:
        harness.start(model_info(tokenizer))
        request_id, accepted, added = harness.generate(constrained(), prompt_text="Sentiment as JSON:")
        forced = added.forced_token_ids
        assert tokenizer.decode(forced) == FORCED_TEXT
        answer = tokenizer.hf.encode('positive"}', add_special_tokens=False)
        first = harness.feed(request_id, answer[:1])
        assert first.num_new_tokens == len(forced) + 1
        assert first.text.startswith(FORCED_TEXT)
        rest = harness.feed(request_id, answer[1:], finish_reason=FinishReason.LENGTH)
        assert first.text + rest.text == FORCED_TEXT + 'positive"}'
        # a request that asked for logprobs samples every token itself
        _, _, plain = harness.generate(constrained(logprobs=0), prompt_text="Sentiment as JSON:")
        assert plain.forced_token_ids == []
        # a stop string the forced start completes: the token that completes it is sampled, not forced
        _, _, stopped = harness.generate(constrained(stop=["iment"]), prompt_text="Sentiment as JSON:")
        assert tokenizer.decode(stopped.forced_token_ids) == '{"sent'
    finally:
        harness.close()
