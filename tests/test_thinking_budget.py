"""vLLM's thinking_token_budget without a server: what the tokenizer process builds from where the prompt left the
think block (reasoning.thinking_budget), the worker's count of a sequence's tokens inside it and the end marker it
forces (thinking.ThinkingCounter), and the rows' masks, in process and in the grammar process (a budget whose block
closed costs nothing more). The routes: tests/test_reasoning_qa.py (with a reasoning parser), tests/test_vllm_compat.py
(without one), tests/test_offline_api.py (LLM has none)."""

from __future__ import annotations

from pathlib import Path

import llguidance
import pytest

from pagoda.services.protocol.reasoning import PROMPT_CLOSED, PROMPT_OPENED, THINK_END, thinking_budget
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.services.worker.grammar import NO_END_LEFT, GrammarRows
from pagoda.services.worker.grammar_process import MaskProcess, TokenizerSpec
from pagoda.services.worker.thinking import Phase, ThinkingCounter
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import NewRequest, SamplingParams, StepPlan, StructuredOutputs, ThinkingBudget

END_IDS = [9617, 17400, 46]  # SmolLM2's `</`, `think`, `>`
PIECES = {9617: b"</", 17400: b"think", 46: b">", 44: b"<", 198: b"\n", 1: b" a", 2: b" b", 3: b"\xe6\x97", 4: b"\xa5"}


def opened(max_tokens: int) -> ThinkingBudget:
    return ThinkingBudget(max_tokens=max_tokens, end=THINK_END, end_token_ids=END_IDS)


def closing(max_tokens: int) -> ThinkingBudget:
    """A budget whose output has a block only if it opens one."""
    return ThinkingBudget(max_tokens=max_tokens, end=THINK_END, end_token_ids=END_IDS, start="<think>")


def run(counter: ThinkingCounter, wanted: list[int]) -> list[int]:
    """The output of a model that writes `wanted` (then " a" forever) where the counter lets it choose."""
    out: list[int] = []
    for token_id in [*wanted, *[1] * 20][:len(wanted) + 8]:
        chosen = counter.forced_token_id()
        chosen = token_id if chosen is None else chosen
        assert counter.push(chosen, PIECES[chosen])
        out.append(chosen)
    return out


# ------------------------------------------------------------------ the counter


@pytest.mark.parametrize("budget", [0, 1, 2, 5])
def test_a_spent_budget_forces_the_end_marker_then_lets_the_answer_go(budget: int) -> None:
    counter = ThinkingCounter.of(opened(budget))
    out = run(counter, [1, 2] * 5)
    assert out[:budget] == ([1, 2] * 5)[:budget] and out[budget:budget + 3] == END_IDS
    assert counter.done and counter.num_thinking == budget and counter.forced_token_id() is None


def test_the_model_closing_the_block_itself_is_left_alone() -> None:
    """Its marker's tokens count while it writes them (vLLM's), and the block closes on the last one."""
    counter = ThinkingCounter.of(opened(6))
    wanted = [1, 2, *END_IDS, 2, 2]
    assert run(counter, wanted)[:len(wanted)] == wanted and counter.done and counter.num_thinking == 4


def test_a_marker_the_model_began_is_finished_where_it_stands() -> None:
    """The budget runs out after `</` `think`: only `>` is forced (not a second `</`)."""
    counter = ThinkingCounter.of(opened(3))
    assert run(counter, [1, 9617, 17400, 2])[:4] == [1, 9617, 17400, 46] and counter.done


def test_the_end_marker_across_other_tokenizations_closes_the_block() -> None:
    """`<` then `/think>` spelled by other tokens: the text decides, as the reasoning parser's."""
    counter = ThinkingCounter.of(opened(10))
    for token_id, piece in ((1, b" a"), (44, b"<"), (5, b"/thi"), (6, b"nk>")):
        assert counter.push(token_id, piece)
    assert counter.done


def test_an_output_that_opens_the_block_counts_after_the_opener() -> None:
    counter = ThinkingCounter.of(closing(2))
    for token_id, piece in ((198, b"\n"), (44, b"<"), (7, b"think"), (46, b">")):
        assert counter.forced_token_id() is None
        counter.push(token_id, piece)
    assert counter.phase is Phase.THINKING and counter.num_thinking == 0
    assert run(counter, [1, 2, 2])[:5] == [1, 2, *END_IDS]


def test_an_output_that_opens_no_block_is_not_bounded() -> None:
    counter = ThinkingCounter.of(closing(0))
    counter.push(1, b" a")
    assert counter.done and counter.forced_token_id() is None
    cut = ThinkingCounter.of(closing(0))  # a character cut across tokens decides nothing until it is whole
    cut.push(3, b"\xe6\x97")
    assert cut.phase is Phase.OPENING
    cut.push(4, b"\xa5")
    assert cut.done


def test_budget_zero_after_an_opener_closes_at_once() -> None:
    counter = ThinkingCounter.of(closing(0))
    counter.push(8, b"<think>")
    assert counter.forced_token_id() == END_IDS[0]
    opener_and_end = ThinkingCounter.of(closing(0))  # both in one token: no block left to bound
    opener_and_end.push(9, b"<think></think>")
    assert opener_and_end.done


def test_a_token_other_than_the_forced_one_is_reported() -> None:
    counter = ThinkingCounter.of(opened(0))
    assert not counter.push(1, b" a")


# ------------------------------------------------------------------ what the tokenizer process builds


def test_the_budget_follows_where_the_prompt_left_the_block(tokenizer: Tokenizer) -> None:
    """Closed: nothing to bound. Opened: the prompt's own tokens inside the block are spent (vLLM's count); the
    output starts inside. Neither: under qwen3 the output may open it, under deepseek_r1 it starts inside."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    assert thinking_budget(5, "qwen3", PROMPT_CLOSED, "<think>\n\n</think>\n\n", encode) is None
    prefill = "<|im_start|>assistant\n<think>\nLet me see"
    spent = len(encode("\nLet me see"))
    budget = thinking_budget(10, "qwen3", PROMPT_OPENED, prefill, encode)
    assert budget == ThinkingBudget(max_tokens=10 - spent, end="</think>", end_token_ids=END_IDS)
    assert thinking_budget(2, "deepseek_r1", PROMPT_OPENED, prefill, encode).max_tokens == 0
    assert thinking_budget(7, "qwen3", "", "<|im_start|>assistant\n", encode).start == "<think>"
    assert thinking_budget(7, "deepseek_r1", "", "<|im_start|>assistant\n", encode).start == ""


@pytest.mark.parametrize("value", [-2, 2**31, True, 1.5])
def test_bad_budgets_are_refused_naming_the_field(value: object) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(thinking_token_budget=value).validate()  # type: ignore[arg-type]
    assert caught.value.param == "thinking_token_budget"
    assert SamplingParams(thinking_token_budget=-1).validate().bounds_thinking is False  # vLLM's "unlimited"
    with pytest.raises(InvalidRequestError) as beams:
        SamplingParams(thinking_token_budget=3, use_beam_search=True, n=2).validate()
    assert beams.value.param == "thinking_token_budget"


# ------------------------------------------------------------------ the rows' masks


def new_request(seq_id: int, budget: ThinkingBudget, generated: list[int] | None = None,
                **params: object) -> NewRequest:
    return NewRequest(seq_id, [1, 2, *(generated or [])], 2, [0], 0, SamplingParams(thinking=budget, **params), 0)


def mask_ids(masks: tuple, row: int, vocab_size: int) -> list[int]:
    words = masks[1][row]
    return [i for i in range(vocab_size) if int(words[i // 32]) >> (i % 32) & 1]


def test_rows_force_the_end_then_let_go(ll: llguidance.LLTokenizer, tokenizer: Tokenizer) -> None:
    """A spent budget's row is masked to its next end id, past allowed_token_ids too (vLLM forces it after its other
    processors); a row under budget has no mask; once the block closes the sequence asks nothing more. A recomputed
    sequence (its tokens replayed) stands where it was."""
    vocab = tokenizer.vocab_size
    rows = GrammarRows(lambda: ll, vocab)
    word = tokenizer.encode(" well", add_special_tokens=False)[0]
    rows.apply(StepPlan(0, [], [], new_requests=[new_request(1, opened(1)), new_request(2, opened(5)),
                                                 new_request(3, opened(1), allowed_token_ids=[word])]))
    assert rows.has_matchers([2]) and rows.bitmask([2]) is None  # under budget: nothing to mask
    rows.accept([1, 2, 3], [word, word, word])
    masks = rows.bitmask([1, 2, 3])
    assert masks is not None and masks[0].tolist() == [True, False, True]
    assert mask_ids(masks, 0, vocab) == [END_IDS[0]] and mask_ids(masks, 1, vocab) == [END_IDS[0]]
    for end_id in END_IDS:
        rows.accept([1], [end_id])
    assert not rows.has_matchers([1]) and rows.has_matchers([2]) and rows.constrains([3])
    rows.apply(StepPlan(1, [], [], new_requests=[new_request(4, opened(1), [word, END_IDS[0]])]))
    masks = rows.bitmask([4])
    assert masks is not None and mask_ids(masks, 0, vocab) == [END_IDS[1]]
    assert rows.take_failures() == []


def test_bad_words_that_ban_the_forced_end_fail_the_row(ll: llguidance.LLTokenizer, tokenizer: Tokenizer) -> None:
    rows = GrammarRows(lambda: ll, tokenizer.vocab_size)
    rows.apply(StepPlan(0, [], [], new_requests=[
        new_request(1, opened(0), bad_words=["</"], bad_words_token_ids=[[END_IDS[0]]])]))
    assert rows.bitmask([1]) is None and rows.take_failures() == [(1, NO_END_LEFT)]


def test_a_budget_with_a_grammar_hands_over_at_the_end_marker(ll: llguidance.LLTokenizer,
                                                            tokenizer: Tokenizer) -> None:
    """response_format with a budget: the forced `</think>` starts the grammar (constrain_after_reasoning)."""
    rows = GrammarRows(lambda: ll, tokenizer.vocab_size)
    constraint = StructuredOutputs(choice=["yes"], reasoning_end=THINK_END)
    rows.apply(StepPlan(0, [], [], new_requests=[new_request(1, opened(0), structured_outputs=constraint)]))
    for end_id in END_IDS:
        masks = rows.bitmask([1])
        assert masks is not None and mask_ids(masks, 0, tokenizer.vocab_size) == [end_id]
        rows.accept([1], [end_id])
    masks = rows.bitmask([1])
    yes = tokenizer.encode("yes", add_special_tokens=False)[0]
    assert masks is not None and yes in mask_ids(masks, 0, tokenizer.vocab_size) and rows.has_matchers([1])


def test_the_grammar_process_masks_alike_and_releases_a_closed_block(smollm2_dir: Path,
                                                                    tokenizer: Tokenizer) -> None:
    """In the grammar process (the default on CUDA): the same forced masks; once the block closed, the worker's
    mirror stops counting the sequence as one with a matcher (its steps no longer wait for its tokens)."""
    spec = TokenizerSpec(str(smollm2_dir), tokenizer.vocab_size, (tokenizer.eos_token_id,))
    word = tokenizer.encode(" well", add_special_tokens=False)[0]
    process = MaskProcess(spec, max_rows=4)
    try:
        process.apply(StepPlan(0, [], [], new_requests=[new_request(1, opened(1)), new_request(2, opened(9))]))
        assert process.has_matchers([1]) and process.has_matchers([2])
        masks = process.advance_and_fill([([1, 2], [word, word])], [1, 2])
        assert masks is not None and masks[0].tolist() == [True, False]
        assert mask_ids(masks, 0, tokenizer.vocab_size) == [END_IDS[0]]
        for end_id in END_IDS[1:]:
            process.advance_and_fill([([1, 2], [END_IDS[END_IDS.index(end_id) - 1], word])], [1, 2])
        assert process.has_matchers([1])  # the last end id is not accepted yet
        assert process.advance_and_fill([([1, 2], [END_IDS[-1], word])], [1, 2]) is None
        assert not process.has_matchers([1]) and process.has_matchers([2])
        assert process.take_failures() == []
    finally:
        process.close()
