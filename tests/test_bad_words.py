"""vLLM's bad_words: each word tokenized as given and after a space; a word's last token is banned at a step where
the tokens generated so far end with its others (a one-token word always). On the worker, through the offline
LLM and over HTTP (n > 1, streaming, with structured outputs), and refused where it cannot work."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from pagoda import LLM, InvalidRequestError, SamplingParams
from pagoda.services.tokenizer.bad_words import bad_words_token_ids
from pagoda.services.worker.sampling_state import SamplingState
from pagoda.shared.messages import NewRequest, StructuredOutputs
from pagoda.shared.messages import SamplingParams as WireParams
from tests.harness import Server

PROMPT = "The capital of France is"


# ---------------------------------------------------------------- the worker's per-row state (no model)


def _new(seq_id: int, words: list[list[int]], generated: list[int] = ()) -> NewRequest:  # type: ignore[assignment]
    params = WireParams(bad_words=["w"] * len(words), bad_words_token_ids=words)
    return NewRequest(seq_id=seq_id, token_ids=[1, 2, 3, *generated], num_prompt_tokens=3, block_ids=[],
                      num_computed_tokens=0, sampling=params, seed=seq_id)


def _bans(state: SamplingState, rows: list[int]) -> list[set[int]]:
    banned = state.metadata(np.asarray(rows, dtype=np.int64)).banned_token_ids
    return [set() if banned is None else {t for t in row if t >= 0} for row in banned.tolist()]


def test_the_worker_bans_a_last_token_only_after_the_words_other_tokens() -> None:
    state = SamplingState(4, 64, torch.device("cpu"), eos_token_ids=[0])
    state.admit([(0, _new(0, [])), (1, _new(1, [[9], [5, 6, 7]])), (2, _new(2, [[5, 6, 7]], generated=[5, 6]))])
    # a row without bad words pays nothing: no table, no bans (batches of such rows never build one)
    assert state.metadata(np.asarray([0])).banned_token_ids is None
    assert _bans(state, [0, 1, 2]) == [set(), {9}, {7}]  # row 2 was preempted after "5 6": its window is rebuilt
    rows = np.asarray([1, 2])
    for token, expected in ((5, [{9}, set()]), (6, [{9, 7}, {7}]), (8, [{9}, set()]), (5, [{9}, set()])):
        state.metadata(rows)
        state.record(rows, torch.tensor([token, token]))
        assert _bans(state, [1, 2]) == expected, token
    # a reused row forgets its last owner's words; a longer word widens the tables and keeps the other rows' windows
    state.admit([(1, _new(3, [])), (3, _new(4, [[4, 4, 4, 4, 4]]))])
    state.metadata(np.asarray([2, 3]))
    state.record(np.asarray([2, 3]), torch.tensor([6, 4]))
    assert _bans(state, [1, 2, 3]) == [set(), {7}, set()]
    for _ in range(3):
        state.metadata(np.asarray([3]))
        state.record(np.asarray([3]), torch.tensor([4]))
    assert _bans(state, [3]) == [{4}]


def test_bad_words_are_tokenized_as_vllm_tokenizes_them(smollm2_dir: Path) -> None:
    from pagoda.services.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2_dir)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    # as given (leading whitespace stripped) and after a space, where that spelling has as many tokens
    assert bad_words_token_ids(["  Hello world", "no"], tokenizer) == [
        encode("Hello world"), encode(" Hello world"), encode("no"), encode(" no")]
    with pytest.raises(InvalidRequestError) as caught:
        bad_words_token_ids(["a" * 200], tokenizer)
    assert caught.value.param == "bad_words"


# ---------------------------------------------------------------- the offline engine


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path) -> LLM:
    return LLM(str(smollm2_dir), max_model_len=512)


@pytest.mark.slow
def test_offline_bad_words_change_only_the_banned_token(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    base = llm.generate(PROMPT, greedy)[0].outputs[0].token_ids
    word = llm.get_tokenizer().decode(base[5:7])  # two tokens the model says, " answer is"
    banned = SamplingParams(temperature=0.0, max_tokens=10, bad_words=[word])
    plain, out = (o.outputs[0].token_ids for o in llm.generate([PROMPT, PROMPT], [greedy, banned]))
    assert plain == base  # a companion without bad words is untouched
    assert out[:6] == base[:6] and out[6] != base[6]  # the word's first token stays, its last one goes
    one = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=10, bad_words=["Paris"]))[0].outputs[0]
    assert base[0] not in one.token_ids and "Paris" not in one.text


@pytest.mark.slow
def test_offline_bad_words_hold_for_every_sampled_completion(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    words = ["the", "a", "Paris"]
    banned_ids = {ids[0] for ids in bad_words_token_ids(words, tokenizer)}
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=12, ignore_eos=True, bad_words=words)
    outputs = llm.generate(PROMPT, params)[0].outputs
    assert len(outputs) == 3
    assert all(not banned_ids.intersection(o.token_ids) for o in outputs)


@pytest.mark.slow
def test_offline_bad_words_apply_under_a_grammar(llm: LLM) -> None:
    """With structured outputs the grammar's mask and the bans both hold (the grammar's forced start is sampled,
    not fast-forwarded, so a banned word cannot slip in with it)."""
    choice = StructuredOutputs(choice=["Paris", "Lyon"])
    free = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=choice))
    banned = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=choice,
                                                 bad_words=["Paris"]))
    assert free[0].outputs[0].text == "Paris" and banned[0].outputs[0].text == "Lyon"


@pytest.mark.parametrize(("values", "param"), [
    ({"bad_words": [" "]}, "bad_words"),
    ({"bad_words": ["x"] * 129}, "bad_words"),
    ({"bad_words": ["no"], "use_beam_search": True, "temperature": 0.0}, "bad_words"),
    ({"bad_words_token_ids": [[5]]}, "bad_words_token_ids"),
])
def test_offline_bad_words_refusals(values: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**values)  # type: ignore[arg-type]
    assert caught.value.param == param


# ---------------------------------------------------------------- the server


def _completion(server: Server, **body: object) -> dict:
    response = httpx.post(server.url + "/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 10, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.slow
def test_server_bad_words_on_completions_streamed_and_chat(smollm2_server: Server) -> None:
    def streamed(word: str) -> list[dict]:
        with httpx.stream("POST", smollm2_server.url + "/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stream": True,
                                "bad_words": [word]}) as response:
            assert response.status_code == 200
            return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]

    with ThreadPoolExecutor(2) as pool:  # independent requests at once (the engine batches them)
        chatting = pool.submit(lambda: httpx.post(smollm2_server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8,
            "temperature": 0, "bad_words": ["Paris"]}))
        base = _completion(smollm2_server, return_token_ids=True)["choices"][0]["token_ids"]
        tokens = httpx.post(smollm2_server.url + "/detokenize", json={"tokens": base[5:7]}, timeout=30).json()
        word = tokens["prompt"]
        streaming = pool.submit(streamed, word)  # needs only the word, as the n=2 request
        body = _completion(smollm2_server, n=2, bad_words=[word], return_token_ids=True)
        chunks = streaming.result()
        chat = chatting.result()
    for choice in body["choices"]:
        assert choice["token_ids"][:6] == base[:6] and choice["token_ids"][6] != base[6]
    assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]
    assert chat.status_code == 200 and "Paris" not in chat.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
@pytest.mark.parametrize("body", [
    {"bad_words": ["  "]},
    {"bad_words": ["no"], "use_beam_search": True, "n": 2, "best_of": 2},
    {"bad_words": ["a" * 200]},
    {"bad_words": "no"},
])
def test_server_refuses_bad_words_it_cannot_honour(smollm2_server: Server, body: dict[str, object]) -> None:
    response = httpx.post(smollm2_server.url + "/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "bad_words"


@pytest.mark.slow
def test_server_fails_a_grammar_row_whose_bad_words_ban_all_it_allows(smollm2_server: Server) -> None:
    """A choice whose every start is banned: a 400 naming bad_words (it was a 200 whose text the grammar forbids:
    the sampler drew token 0 with every allowed token banned); the other choice still comes out when one is left."""
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "guided_choice": ["Paris"], "bad_words": ["Paris"]}
    response = httpx.post(smollm2_server.url + "/v1/completions", timeout=60, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "bad_words" and "no token that the structured output allows" in error["message"]
    left = _completion(smollm2_server, guided_choice=["Paris", "Lyon"], bad_words=["Paris"], max_tokens=5)
    assert left["choices"][0]["text"] == "Lyon"
