"""The api's Generation: output that arrived before an abnormal end (abort, engine error) reaches the client, then
the error; both for rendered rows and for text deltas rendered in the api."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.services.api.errors import UpstreamError
from pagoda.services.api.generation import Generation
from pagoda.services.api.metrics import ApiMetrics
from pagoda.services.api.pool import Rows, Ticket
from pagoda.services.protocol.render import CompletionRenderer
from pagoda.shared.messages import FinishReason, SchedulerStats, TextDelta


def _metrics() -> ApiMetrics:
    stats = SchedulerStats(time=0.0, num_running=1, num_waiting=0, kv_blocks_free=10, kv_blocks_total=20,
                           kv_cache_usage=0.5, prefix_hit_tokens_total=0, prefix_query_tokens_total=0,
                           num_preemptions_total=0, prompt_tokens_total=0, generation_tokens_total=0,
                           num_steps_total=0, worker_ready=True, worker_alive=True, tokenizer_ids=["tok"],
                           tokenizer_requests_total=[1], max_model_len=100)
    return ApiMetrics(lambda: stats, None, "m")


def _generation(n: int, stream: bool) -> Generation:
    renderer = CompletionRenderer("cmpl-1", "m", 0, want_logprobs=False, include_usage=False, echo=False)
    return Generation(Ticket(["r1"], b"tok"), n, time.monotonic(), _metrics(), renderer, stream=stream)


def _drain(gen: Generation) -> tuple[list[bytes], UpstreamError | None]:
    """What the stream handler writes, batch by batch, until the generation ends or raises."""
    async def run() -> tuple[list[bytes], UpstreamError | None]:
        written: list[bytes] = []
        try:
            while not gen.finished:
                written.append(await gen.next_batch())
        except UpstreamError as exc:
            return written, exc
        return written, None
    return asyncio.run(run())


def _row(index: int, reason: int, data: bytes, num_new_tokens: int = 1) -> tuple[str, int, int, int, int, bytes]:
    return ("r1", index, num_new_tokens, reason, 0, data)


@pytest.mark.parametrize("reason, status", [(FinishReason.ABORT, 503), (FinishReason.ERROR, 500)])
def test_rendered_bytes_queued_before_an_abnormal_end_are_written_then_the_error(reason: int, status: int) -> None:
    """Two completions (n = 2): the bytes queued in the same wake-up as the second one's abnormal end, from earlier
    batches and from earlier rows of its own batch, are returned first; the next call raises the end's error."""
    gen = _generation(2, stream=True)
    gen.ticket.queue.put_nowait(Rows([_row(0, -1, b"a0"), _row(1, -1, b"b0")]))
    gen.ticket.queue.put_nowait(Rows([_row(0, -1, b"a1"), _row(1, reason, b"", 0), _row(0, -1, b"a2")]))
    written, error = _drain(gen)
    assert written == [b"a0b0a1a2"]
    assert error is not None and error.http_status == status
    assert [c.num_tokens for c in gen.choices] == [3, 1]
    assert gen.choices[1].finish_reason == reason and not gen.finished


def test_an_abnormal_end_with_nothing_before_it_raises_at_once() -> None:
    gen = _generation(1, stream=True)
    gen.ticket.queue.put_nowait(Rows([_row(0, FinishReason.ABORT, b"", 0)]))
    written, error = _drain(gen)
    assert written == [] and error is not None and error.http_status == 503


def test_an_unstreamed_response_raises_at_its_abnormal_end() -> None:
    """Unstreamed there is nothing to write: the error is the answer at once, whatever came before."""
    gen = _generation(2, stream=False)
    gen.ticket.queue.put_nowait(Rows([_row(0, FinishReason.STOP, b'{"text": "x"}')]))
    gen.ticket.queue.put_nowait(Rows([_row(1, FinishReason.ERROR, b"", 0)]))
    written, error = _drain(gen)
    assert written == [] and error is not None and error.http_status == 500


def test_normal_ends_finish_without_error() -> None:
    gen = _generation(2, stream=True)
    gen.ticket.queue.put_nowait(Rows([_row(0, FinishReason.STOP, b"a"), _row(1, FinishReason.LENGTH, b"b")]))
    written, error = _drain(gen)
    assert (written, error, gen.finished) == ([b"ab"], None, True)


def _events(data: bytes) -> list[dict]:
    return [json.loads(line[len(b"data: "):]) for line in data.split(b"\n") if line.startswith(b"data: {")]


def test_text_deltas_before_an_abort_are_rendered_and_the_abort_is_not() -> None:
    """A tokenizer that sends text: the deltas before the abort in the same wake-up are rendered as chunks; the
    abort itself renders no chunk (it is answered with the error), as the rendering tokenizer does."""
    gen = _generation(1, stream=True)
    gen.ticket.queue.put_nowait([TextDelta("r1", 0, "Hello", 1)])
    gen.ticket.queue.put_nowait([TextDelta("r1", 0, " world", 1), TextDelta("r1", 0, "", 0, FinishReason.ABORT)])
    written, error = _drain(gen)
    assert len(written) == 1 and error is not None and error.http_status == 503
    events = _events(written[0])
    assert "".join(e["choices"][0]["text"] for e in events) == "Hello world"
    assert all(e["choices"][0]["finish_reason"] is None for e in events)


def test_a_chunk_of_several_tokens_counts_each_token_in_the_inter_token_latency() -> None:
    """With --stream-interval a delta carries several tokens: the gap before it counts once per token, each the
    gap spread over them, so the histogram's count is the tokens after the first and its sum the decode time."""
    gen = _generation(1, stream=True)
    for tokens in (1, 4, 3):
        gen.ticket.queue.put_nowait(Rows([_row(0, -1, b"x", tokens)]))
        asyncio.run(gen.next_batch())
    text = gen._metrics.render(None)[0].decode()  # flushes the tally
    first, last = gen.first_token_at, gen.choices[0].last_token_at
    assert first is not None
    for name in ("pagoda_inter_token_latency_seconds", "vllm:inter_token_latency_seconds"):
        family = next(f for f in text_string_to_metric_families(text) if f.name == name)
        values = {s.name.removeprefix(name): s.value for s in family.samples if not s.name.endswith("_bucket")}
        assert values["_count"] == 4 + 3
        assert values["_sum"] == pytest.approx(last - first, rel=1e-6, abs=1e-9)
