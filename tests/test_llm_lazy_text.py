"""LLM.generate steps without deltas (the text of a completion without stop strings is detokenized at its end, its
tokens copied from the scheduler's sequence): the outputs equal those of stepping with deltas, token for token
and character for character, with stop strings, logprobs, n > 1, stop token ids, preemption, a read in the middle
and an abort."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.outputs import RequestOutput

# token ids below 512 (the tiny model's vocabulary): SmolLM2's bytes and short merges
PROMPTS = [[260, 301, 412, 288, 33], [229, 244, 244, 200, 210, 240, 159], [300]]


def _params() -> list[SamplingParams]:
    """Sampled (seeded) from a random model over SmolLM2's first 512 ids: byte tokens that split characters."""
    return [SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=2, max_tokens=30, stop=["e", "\u00e9"], ignore_eos=True),
            SamplingParams(temperature=1.0, seed=3, max_tokens=25, logprobs=2, n=2, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=4, max_tokens=28, stop_token_ids=[300, 301, 302, 303, 304]),
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=1)]


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path) -> LLM:
    # a tiny random model whose vocabulary is SmolLM2's first 512 ids; a small KV cache: rows get preempted
    return LLM("tiny", load_format="dummy", tokenizer=str(smollm2_dir), seed=5, max_num_seqs=8, num_kv_blocks=14,
               block_size=16, max_model_len=128)


def _add(llm: LLM) -> list[str]:
    return [llm.engine.add_request(prompt, params) for prompt in PROMPTS for params in _params()]


def _summary(output: RequestOutput) -> list[tuple[list[int], str, str | None, list[dict[int, float]] | None]]:
    return [(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in output.outputs]


def _run(llm: LLM, deltas: bool) -> list[RequestOutput]:
    request_ids = _add(llm)
    while llm.engine.has_unfinished_requests():
        llm.engine.step(deltas=deltas)
    return [llm.engine.pop_output(request_id) for request_id in request_ids]


def test_outputs_without_deltas_equal_those_with(llm: LLM) -> None:
    preemptions = llm.engine.scheduler.stats.num_preemptions
    with_deltas = _run(llm, deltas=True)
    assert llm.engine.scheduler.stats.num_preemptions > preemptions, "the test meant to preempt rows"
    quiet = _run(llm, deltas=False)
    assert [_summary(o) for o in quiet] == [_summary(o) for o in with_deltas]
    assert any("\ufffd" in c.text or any(ord(ch) > 127 for ch in c.text) for o in quiet for c in o.outputs)
    assert any(c.finish_reason == "stop" for o in quiet for c in o.outputs)
    generated = llm.generate(PROMPTS, _params()[0])  # type: ignore[arg-type]
    assert [_summary(o) for o in generated] == [_summary(o) for o in with_deltas[::len(_params())]]


def test_reads_and_aborts_in_the_middle_see_every_token(llm: LLM) -> None:
    runs = []
    for deltas in (True, False):
        request_ids = _add(llm)
        for _ in range(12):
            llm.engine.step(deltas=deltas)
        middle = [_summary(llm.engine.get_output(request_id)) for request_id in request_ids]
        llm.engine.abort_request(request_ids[0])
        for _ in range(6):
            llm.engine.step(deltas=deltas)
        later = [_summary(llm.engine.get_output(request_id)) for request_id in request_ids]
        for request_id in request_ids:
            llm.engine.abort_request(request_id)
        runs.append((middle, later, [_summary(llm.engine.pop_output(request_id)) for request_id in request_ids]))
        assert not llm.engine.has_unfinished_requests()
    assert runs[0] == runs[1]
    middle = runs[1][0]
    assert any(tokens for completions in middle for tokens, _, _, _ in completions)
