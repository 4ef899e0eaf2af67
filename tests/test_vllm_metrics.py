"""vLLM's metric names on /metrics: each `vllm:*` family has the type, labels and buckets vLLM V1 gives it, and after
real requests on a served tiny model (two api processes, so the histograms and counters merge across them) its
values agree with what the clients were told and with the `pagoda_*` twins; the gauges return to 0 when idle."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from pagoda.services.api.errors import UpstreamError
from pagoda.services.api.generation import Generation
from pagoda.services.api.metrics import ITL_BUCKETS_S, VLLM_ITL_BUCKETS_S, ApiMetrics, buckets_1_2_5
from pagoda.services.api.pool import Ticket
from pagoda.services.api.stats import combine_stats
from pagoda.shared.messages import (
    REQUEST_PHASE_BUCKETS_S,
    REQUEST_PHASES,
    STEP_TOKEN_BUCKETS,
    FinishReason,
    HistogramCounts,
    RequestFailed,
    SchedulerStats,
)
from tests.harness import Server, http_client, running_server, tiny_llama_over_smollm2_vocab, wait_until

MAX_MODEL_LEN = 256
ENGINE_LABELS = {"model_name", "engine"}
# name -> (type, labels besides model_name and engine); counters as the parser names them (no _total)
EXPECTED: dict[str, tuple[str, set[str]]] = {
    "vllm:num_requests_running": ("gauge", set()),
    "vllm:num_requests_waiting": ("gauge", set()),
    "vllm:kv_cache_usage_perc": ("gauge", set()),
    "vllm:prefix_cache_queries": ("counter", set()),
    "vllm:prefix_cache_hits": ("counter", set()),
    "vllm:num_preemptions": ("counter", set()),
    "vllm:prompt_tokens": ("counter", set()),
    "vllm:generation_tokens": ("counter", set()),
    "vllm:request_success": ("counter", {"finished_reason"}),
    "vllm:time_to_first_token_seconds": ("histogram", set()),
    "vllm:inter_token_latency_seconds": ("histogram", set()),
    "vllm:e2e_request_latency_seconds": ("histogram", set()),
    "vllm:request_queue_time_seconds": ("histogram", set()),
    "vllm:request_prefill_time_seconds": ("histogram", set()),
    "vllm:request_decode_time_seconds": ("histogram", set()),
    "vllm:request_inference_time_seconds": ("histogram", set()),
    "vllm:request_prompt_tokens": ("histogram", set()),
    "vllm:request_generation_tokens": ("histogram", set()),
    "vllm:request_params_n": ("histogram", set()),
    "vllm:request_params_max_tokens": ("histogram", set()),
    "vllm:iteration_tokens_total": ("histogram", set()),
}
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
BUCKETS: dict[str, list[float]] = {  # vLLM V1's (vllm/v1/metrics/loggers.py)
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    **{name: LATENCY_BUCKETS for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                                          "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                                          "vllm:request_inference_time_seconds")},
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    **{name: [1, 2, 5, 10, 20, 50, 100, 200] for name in ("vllm:request_prompt_tokens",
                                                          "vllm:request_generation_tokens",
                                                          "vllm:request_params_max_tokens")},
}
TWINS = {"vllm:prompt_tokens_total": "pagoda_prompt_tokens_total",
         "vllm:generation_tokens_total": "pagoda_generation_tokens_total",
         "vllm:prefix_cache_queries_total": "pagoda_prefix_cache_query_tokens_total",
         "vllm:prefix_cache_hits_total": "pagoda_prefix_cache_hit_tokens_total",
         "vllm:num_preemptions_total": "pagoda_num_preemptions_total",
         "vllm:kv_cache_usage_perc": "pagoda_kv_cache_usage_ratio",
         "vllm:num_requests_running": "pagoda_num_requests_running",
         "vllm:num_requests_waiting": "pagoda_num_requests_waiting",
         "vllm:time_to_first_token_seconds_count": "pagoda_time_to_first_token_seconds_count",
         "vllm:inter_token_latency_seconds_count": "pagoda_inter_token_latency_seconds_count",
         "vllm:inter_token_latency_seconds_sum": "pagoda_inter_token_latency_seconds_sum",
         "vllm:e2e_request_latency_seconds_count": "pagoda_e2e_request_latency_seconds_count"}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def test_buckets_1_2_5() -> None:
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]
    assert buckets_1_2_5(256) == [1, 2, 5, 10, 20, 50, 100, 200]
    assert buckets_1_2_5(0) == []


def _stats(replica: int, tokenizer: str) -> SchedulerStats:
    return SchedulerStats(time=0.0, num_running=replica + 1, num_waiting=0, kv_blocks_free=10, kv_blocks_total=20,
                          kv_cache_usage=0.5, prefix_hit_tokens_total=0, prefix_query_tokens_total=0,
                          num_preemptions_total=0, prompt_tokens_total=0, generation_tokens_total=0, num_steps_total=0,
                          worker_ready=True, worker_alive=True, tokenizer_ids=[tokenizer], tokenizer_requests_total=[1],
                          max_model_len=100)


def test_several_replicas_are_engines_and_requests_count_where_they_ran() -> None:
    """With two replicas each scheduler series has its replica's id as `engine`; a request is counted under the
    engine whose scheduler lists its tokenizer; a completion whose prompt failed in the engine counts as error, one
    cut short (the client left) as abort."""
    replicas = [("0", _stats(0, "tok-a")), ("1", _stats(1, "tok-b"))]
    metrics = ApiMetrics(lambda: replicas[0][1], lambda: replicas, "m", {"block_size": "16"})
    assert (metrics.engine_of(b"tok-a"), metrics.engine_of(b"tok-b")) == ("0", "1")
    gen = Generation(Ticket(["r1", "r2"], b"tok-b"), 2, time.monotonic(), metrics, None, stream=True)  # type: ignore[arg-type]
    gen.accepted_at = time.monotonic()
    gen.choices[0].finish_reason = FinishReason.STOP
    gen._failed.add(1)  # the second prompt's RequestFailed
    metrics.vllm_finished(gen, 7)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render(None)[0].decode())}
    running = {s.labels["engine"]: s.value for s in families["vllm:num_requests_running"].samples}
    assert running == {"0": 1, "1": 2}
    success = {(s.labels["engine"], s.labels["finished_reason"]): s.value
               for s in families["vllm:request_success"].samples if s.name.endswith("_total")}
    assert {key: value for key, value in success.items() if value} == {("1", "stop"): 1, ("1", "abort"): 1,
                                                                        ("1", "error"): 2}
    info = {s.labels["engine"]: s.labels for s in families["vllm:cache_config_info"].samples}
    assert info["1"] == {"engine": "1", "block_size": "16", "num_gpu_blocks": "20"}
    max_tokens = {s.name: s.value for s in families["vllm:request_params_max_tokens"].samples
                  if s.labels["engine"] == "1" and not s.name.endswith("_bucket")}
    assert (max_tokens["vllm:request_params_max_tokens_count"], max_tokens["vllm:request_params_max_tokens_sum"]) \
        == (4, 28)


def _histogram_samples(metrics: ApiMetrics, name: str) -> dict[tuple[str, str], float]:
    families = {f.name: f for f in text_string_to_metric_families(metrics.render(None)[0].decode())}
    return {(s.name, s.labels.get("le", "")): s.value for s in families[name].samples
            if not s.name.endswith("_created")}


def test_tallied_inter_token_latencies_equal_direct_observations() -> None:
    """The api tallies ITL once a token over both names' bounds and adds the counts in bulk: every bucket, count
    and sum equals what observing each histogram directly gives, values on bounds, below and above them included;
    nothing is lost when requests end on another series or /metrics reads between observations."""
    rng = random.Random(0)
    bounds = sorted({*ITL_BUCKETS_S, *VLLM_ITL_BUCKETS_S})
    values = [*bounds, 0.0, 1e-6, 1e4, *(rng.choice(bounds) * rng.uniform(0.5, 1.5) for _ in range(3000))]
    tallied = ApiMetrics(lambda: _stats(0, "tok-a"), None, "m")
    direct = ApiMetrics(lambda: _stats(0, "tok-a"), None, "m")
    series = tallied.vllm_series(b"tok-a")
    direct_vllm = direct.vllm_itl.labels("m", "0")
    clock = 0.0
    for i, value in enumerate(values):
        clock += rng.choice((0.0, 0.01, 0.3))  # flushes at observations a second apart, and some reads between
        series.itl.observe(value, clock)
        direct.itl.observe(value)
        direct_vllm.observe(value)
        if i % 997 == 0:
            tallied.render(None)
    gen = Generation(Ticket(["r1"], b"tok-a"), 1, time.monotonic(), tallied, None, stream=True)  # type: ignore[arg-type]
    gen.vllm.itl.observe(0.02, clock)
    direct.itl.observe(0.02)
    direct_vllm.observe(0.02)
    tallied.vllm_finished(gen, None)  # a request's end flushes its series
    assert not any(series.itl.counts)
    for name in ("pagoda_inter_token_latency_seconds", "vllm:inter_token_latency_seconds"):
        got, want = _histogram_samples(tallied, name), _histogram_samples(direct, name)
        assert got.keys() == want.keys() and len(want) > 20
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-9), key


@pytest.mark.parametrize(("status", "counted"), [(400, {}), (500, {"error": 1})])
def test_a_request_refused_after_admission_counts_nowhere(status: int, counted: dict[str, int]) -> None:
    """A prompt failed with a 4xx after it was admitted (a grammar the tokenizer cannot compile) is a refusal, which
    vLLM makes before its engine sees the request: no request_success count. A 5xx there is the engine's error."""
    metrics = ApiMetrics(lambda: _stats(0, "tok-a"), None, "m")
    gen = Generation(Ticket(["r1"], b"tok-a"), 1, time.monotonic(), metrics, None, stream=False)  # type: ignore[arg-type]
    gen.accepted_at = time.monotonic()
    with pytest.raises(UpstreamError):
        gen._raise_if_failed(RequestFailed("r1", status, "the json constraint cannot be compiled"))
    metrics.vllm_finished(gen, 5)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render(None)[0].decode())}
    success = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples
               if s.name.endswith("_total") and s.value}
    assert success == counted


def test_one_replica_reporting_of_several_keeps_its_phase_histograms_and_tenants() -> None:
    """With --data-parallel-size 2 and one replica that never reported (still loading, or failed at start), the one
    that did is served from its own snapshot: the scheduler's phase and step histograms and its tenants came from
    the replicas' combined stats, which carry none of them, so vllm:request_queue_time_seconds and the others were
    served empty and the tenant series vanished while the other replica was missing."""
    phases = [HistogramCounts(counts=[2] + [0] * len(REQUEST_PHASE_BUCKETS_S), sum=0.25) for _ in REQUEST_PHASES]
    steps = HistogramCounts(counts=[0, 3] + [0] * (len(STEP_TOKEN_BUCKETS) - 1), sum=12.0)
    stats = msgspec.structs.replace(_stats(0, "tok-a"), request_phases=phases, step_tokens=steps,
                                    tenant_names=["acme"], tenant_waiting=[1], tenant_running=[2],
                                    tenant_admitted_total=[3], tenant_queue_seconds_total=[0.5])
    metrics = ApiMetrics(lambda: combine_stats([stats]), lambda: [("0", stats)], "m")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(metrics.render(None)[0].decode()) for s in f.samples}
    for phase in REQUEST_PHASES:
        assert total(samples, f"vllm:request_{phase}_time_seconds_count", engine="0") == 2, phase
    assert total(samples, "vllm:iteration_tokens_total_sum", engine="0") == 12
    assert total(samples, "pagoda_tenant_sequences_running", tenant="acme") == 2


REQUEST_SERIES = ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                  "vllm:e2e_request_latency_seconds_count", "vllm:request_params_n_count",
                  "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
                  "vllm:request_params_max_tokens_count")


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_request_series_exist_at_zero_before_any_request(num_replicas: int) -> None:
    """Each engine's request counters and histograms are served at 0 from the first scrape that knows the engine, as
    vLLM makes them at start: they appeared only when the first request reached them, at its count already, so
    rate() and increase() over vllm:request_success_total lost every first request (no sample before it), and an idle
    server's panels read 'no data'."""
    replicas = [(str(i), _stats(i, f"tok-{i}")) for i in range(num_replicas)]
    metrics = ApiMetrics(lambda: replicas[0][1], lambda: replicas, "m")
    samples = {(s.name, s.labels.get("engine"), s.labels.get("finished_reason")): s.value
               for f in text_string_to_metric_families(metrics.render(None)[0].decode()) for s in f.samples}
    for engine, _ in replicas:
        for reason in ("stop", "length", "abort", "error"):
            assert samples[("vllm:request_success_total", engine, reason)] == 0, (engine, reason)
        for name in REQUEST_SERIES:
            assert samples[(name, engine, None)] == 0, (engine, name)


# What Prometheus sends: 2.x (no escaping named: prometheus_client takes underscores), 3.x (UTF-8 names)
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                     "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
                     "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;"
                     "q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1",
                     "application/openmetrics-text", "text/plain;version=1.0.0", None)


@pytest.mark.parametrize("accept", PROMETHEUS_ACCEPT)
def test_every_exposition_format_names_samples_as_their_family(accept: str | None) -> None:
    """Whatever format the scraper negotiates, each sample keeps its family's name (vllm:*, colon and all): Prometheus
    2.x asks for OpenMetrics without naming an escaping, and prometheus_client's underscores escaping wrote
    `vllm_num_requests_running` under `# TYPE vllm:num_requests_running` (client_python#1177), so Prometheus stored
    vllm_* series that no vLLM dashboard queries, each as an untyped metric."""
    metrics = ApiMetrics(lambda: _stats(0, "tok-a"), None, "m")
    gen = Generation(Ticket(["r1"], b"tok-a"), 1, time.monotonic(), metrics, None, stream=True)  # type: ignore[arg-type]
    gen.accepted_at = time.monotonic()
    gen.choices[0].finish_reason = FinishReason.STOP
    metrics.vllm_finished(gen, 5)
    body, content_type = metrics.render(accept)
    if content_type.startswith("application/openmetrics-text"):
        families = list(openmetrics_families(body.decode()))
    else:
        families = list(text_string_to_metric_families(body.decode()))
    by_name = {f.name: f for f in families}
    for name in ("vllm:num_requests_running", "vllm:request_success", "vllm:time_to_first_token_seconds"):
        assert name in by_name and by_name[name].type != "unknown", (name, sorted(by_name))
    success = [s for s in by_name["vllm:request_success"].samples if s.name == "vllm:request_success_total"]
    assert {s.labels["finished_reason"]: s.value for s in success}["stop"] == 1
    for family in families:
        assert family.type != "unknown", family.name
        assert all(s.name.startswith(family.name) for s in family.samples), family.name


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A 2-layer Llama of hidden size 64 over SmolLM2's vocabulary (random weights, its tokenizer)."""
    return tiny_llama_over_smollm2_vocab(tmp_path_factory.mktemp("tiny-vllm-metrics"), smollm2_dir)


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[Server]:
    with running_server(tiny_dir, "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "8", "--num-kv-blocks",
                        "64", "--api-workers", "2") as running:
        yield running


def scrape(server: Server) -> tuple[dict[str, Any], Samples]:
    """The families of /metrics as prometheus_client's parser reads them, and every sample by name and labels."""
    text = http_client().get(server.url + "/metrics", timeout=10).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    return families, samples


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(value for (sample, sample_labels), value in samples.items()
               if sample == name and labels.items() <= dict(sample_labels).items())


def _complete(server: Server, prompt: list[int], **body: Any) -> dict[str, Any]:
    response = http_client().post(server.url + "/v1/completions", timeout=60,
                                  json={"model": _model(server), "prompt": prompt, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _model(server: Server) -> str:
    return str(http_client().get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"])


def _stream_and_leave(server: Server, prompt: list[int]) -> int:
    """A stream the client leaves after its first tokens (the server aborts it); how many chunks it read."""
    body = {"model": _model(server), "prompt": prompt, "max_tokens": 150, "ignore_eos": True, "stream": True}
    read = 0
    with http_client().stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            read += line.startswith("data: {")
            if read >= 2:
                break
    return read


def test_vllm_metrics_agree_with_usage_and_pagoda_twins(server: Server) -> None:
    model = _model(server)
    _, before = scrape(server)
    # length stops, n = 2, a stop on a token id (the one greedy decoding gives first), a stream the client leaves
    prompts = [list(range(300, 300 + k)) for k in (5, 12, 20)]
    seen = [_complete(server, p, max_tokens=m, ignore_eos=True, temperature=0.0)
            for p, m in zip(prompts, (3, 6, 9), strict=True)]
    seen.append(_complete(server, prompts[0] + [777], max_tokens=4, n=2, ignore_eos=True, seed=1))
    first = _complete(server, [400, 401, 402], max_tokens=1, temperature=0.0, ignore_eos=True, return_token_ids=True)
    stop_id = first["choices"][0]["token_ids"][0]
    seen.append(_complete(server, [400, 401, 402], max_tokens=8, temperature=0.0, stop_token_ids=[stop_id]))
    assert seen[-1]["choices"][0]["finish_reason"] == "stop"
    seen.append(first)
    aborted_prompt = list(range(500, 530))
    num_read = _stream_and_leave(server, aborted_prompt)
    assert num_read >= 2
    reasons = [c["finish_reason"] for response in seen for c in response["choices"]]
    num_requests = len(seen) + 1
    num_choices = len(reasons) + 1
    prompt_lens = [5, 12, 20, 6, 3, 3, 30]
    max_tokens = [3, 6, 9, 4, 8, 1, 150]
    engine = {"model_name": model, "engine": "0"}

    def delta(samples: Samples, name: str, **labels: str) -> float:
        return total(samples, name, **labels) - total(before, name, **labels)

    def settled() -> bool:
        _, now = scrape(server)
        return (delta(now, "vllm:request_success_total") == num_choices
                and delta(now, "vllm:request_queue_time_seconds_count") == num_requests
                and total(now, "vllm:num_requests_running") == total(now, "vllm:num_requests_waiting") == 0)

    wait_until(settled, 30, "the requests to finish and the scheduler's snapshot to show them")
    families, after = scrape(server)

    # finish reasons, each completion counted (n = 2 twice), the stream the client left as abort
    for reason in ("stop", "length", "abort"):
        expected = reasons.count(reason) + (reason == "abort")
        assert delta(after, "vllm:request_success_total", finished_reason=reason, **engine) == expected, reason
    assert delta(after, "vllm:request_success_total", finished_reason="error") == 0

    # the twins: same figure under both names (gauges and counters from one snapshot, histograms merged alike)
    for vllm_name, pagoda_name in TWINS.items():
        assert total(after, vllm_name, **engine) == pytest.approx(total(after, pagoda_name)), vllm_name
    assert total(after, "vllm:kv_cache_usage_perc", **engine) == 0.0
    # prompt tokens at admission, once per request (the aborted stream's too); generation tokens sampled
    usage = [response["usage"] for response in seen]
    assert delta(after, "vllm:prompt_tokens_total") == sum(prompt_lens) == sum(u["prompt_tokens"] for u in usage) + 30
    generated = delta(after, "vllm:generation_tokens_total")
    assert generated >= sum(u["completion_tokens"] for u in usage) + 1  # the stream left after a token or more
    assert delta(after, "vllm:e2e_request_latency_seconds_count") == len(seen)  # the ones that completed
    assert delta(after, "vllm:time_to_first_token_seconds_count") == num_requests

    # per completion: its prompt, its tokens, its max_tokens; n once per request
    assert delta(after, "vllm:request_prompt_tokens_count") == num_choices
    assert delta(after, "vllm:request_prompt_tokens_sum") == sum(prompt_lens) + prompt_lens[3]  # n = 2: twice
    gen_sum = delta(after, "vllm:request_generation_tokens_sum")
    assert sum(u["completion_tokens"] for u in usage) + 1 <= gen_sum <= generated
    assert delta(after, "vllm:request_params_max_tokens_count") == num_choices
    assert delta(after, "vllm:request_params_max_tokens_sum") == sum(max_tokens) + max_tokens[3]
    assert delta(after, "vllm:request_params_n_count") == num_requests
    assert delta(after, "vllm:request_params_n_sum") == num_requests + 1

    # the scheduler's phases: every request was admitted and sampled a token
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(after, f"vllm:request_{phase}_time_seconds_count", **engine) == num_requests, phase
    for phase in ("prefill", "decode"):  # inference = prefill + decode, request by request
        assert delta(after, f"vllm:request_{phase}_time_seconds_sum") >= 0
    inference = delta(after, "vllm:request_inference_time_seconds_sum")
    parts = delta(after, "vllm:request_prefill_time_seconds_sum") + delta(after, "vllm:request_decode_time_seconds_sum")
    assert inference == pytest.approx(parts, rel=1e-6, abs=1e-6)
    steps = delta(after, "vllm:iteration_tokens_total_count")
    assert steps > 0 and delta(after, "vllm:iteration_tokens_total_sum") >= generated

    _check_families(families, model)


def _check_families(families: dict[str, Any], model: str) -> None:
    """Each vLLM family: vLLM's type, its labels (model_name and engine on every sample, plus its own), its
    buckets, and cumulative bucket counts that end at _count."""
    for name, (kind, extra) in EXPECTED.items():
        family = families.get(name)
        assert family is not None, f"{name} is not served"
        assert family.type == kind, (name, family.type)
        samples = [s for s in family.samples if not s.name.endswith("_created")]
        assert samples, name
        for sample in samples:
            labels = set(sample.labels) - {"le"}
            assert labels == ENGINE_LABELS | extra, (name, sample.labels)
            assert sample.labels["model_name"] == model and sample.labels["engine"] == "0"
        if kind == "histogram":
            bounds = [s.labels["le"] for s in samples if s.name == name + "_bucket"]
            assert bounds == [*(repr(float(b)) for b in BUCKETS[name]), "+Inf"], name
            counts = [s.value for s in samples if s.name == name + "_bucket"]
            assert counts == sorted(counts), name
            assert counts[-1] == next(s.value for s in samples if s.name == name + "_count"), name
    info = families["vllm:cache_config_info"]
    assert info.type == "gauge"
    (sample,) = info.samples
    assert sample.value == 1.0
    assert sample.labels == {"engine": "0", "block_size": "8", "num_gpu_blocks": "64", "cache_dtype": "auto",
                             "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9"}
