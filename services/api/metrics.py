"""Prometheus metrics: latency histograms observed here, scheduler numbers from its latest snapshot.

Every figure goes out under pagoda's names and, where pagoda measures what vLLM measures, under vLLM V1's too
(`vllm:*`, labels model_name and engine, vLLM's buckets), so dashboards, alerts and autoscalers built for vLLM read
pagoda unchanged. docs/operations.md lists both sets and where they differ.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.openmetrics import exposition as openmetrics_exposition

from pagoda.shared.messages import (
    REQUEST_PHASE_BUCKETS_S,
    REQUEST_PHASES,
    STEP_TOKEN_BUCKETS,
    FinishReason,
    HistogramCounts,
    SchedulerStats,
)

if TYPE_CHECKING:
    from pagoda.services.api.generation import Generation

# prometheus_client picks its value storage from this variable when first imported; the launcher sets it
# (for api_workers > 1) before this process starts, and we only mirror prometheus_client's own choice.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                 240.0, 480.0, 960.0, 1920.0)


# vLLM V1's buckets (vllm/v1/metrics/loggers.py), kept equal so that its dashboards' bucket queries match
VLLM_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                      40.0, 80.0)
VLLM_N_BUCKETS = (1, 2, 5, 10, 20)
VLLM_LABELS = ("model_name", "engine")


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return out
            out.append(mantissa * scale)
        scale *= 10


PerReplica = Callable[[], list[tuple[str, SchedulerStats]]]


class SnapshotCollector:
    """Scheduler gauges and counters read from the latest snapshot at scrape time.

    Every api process sees the same snapshot, so these are never summed across processes. With several
    engine replicas (per_replica lists more than one) each series carries a `replica` label instead.
    """

    def __init__(self, latest: Callable[[], SchedulerStats | None], per_replica: PerReplica | None = None,
                 model_name: str = "", cache_info: dict[str, str] | None = None) -> None:
        self._latest = latest
        self._per_replica = per_replica
        self._model_name = model_name
        self._cache_info = cache_info or {}

    def collect(self) -> Iterator[Metric]:
        replicas = self._per_replica() if self._per_replica is not None else []
        if self._per_replica is not None and (len(replicas) > 1 or (replicas and replicas[0][0] != "0")):
            yield from _families(replicas, labelled=True)
        else:
            # replica 0's own snapshot when it is the one reporting: `latest` combines the replicas (another one may
            # be configured and silent), which keeps neither the phase and step histograms nor the tenants
            stats = replicas[0][1] if replicas else self._latest()
            if stats is None:
                return  # nothing known yet: absent, not a fake zero
            yield from _families([("", stats)], labelled=False)
            replicas = [("0", stats)]
        yield from _vllm_families(replicas, self._model_name, self._cache_info)


def _families(replicas: list[tuple[str, SchedulerStats]], labelled: bool) -> Iterator[Metric]:
    labels = ["replica"] if labelled else None
    gauges = (("pagoda_num_requests_running", "Requests the scheduler is running", "num_running"),
              ("pagoda_num_requests_waiting", "Requests waiting to be scheduled", "num_waiting"),
              ("pagoda_kv_cache_usage_ratio", "Fraction of KV cache blocks in use", "kv_cache_usage"),
              ("pagoda_kv_blocks_free", "Free KV cache blocks", "kv_blocks_free"),
              ("pagoda_kv_blocks_total", "KV cache blocks in all", "kv_blocks_total"))
    # CounterMetricFamily appends the _total suffix itself.
    counters = (("pagoda_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                 "prefix_hit_tokens_total"),
                ("pagoda_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache",
                 "prefix_query_tokens_total"),
                ("pagoda_num_preemptions", "Sequences preempted for lack of KV blocks", "num_preemptions_total"),
                ("pagoda_num_swapped_preemptions", "Preempted sequences whose KV blocks went to host memory "
                 "instead of being recomputed", "num_swapped_total"),
                ("pagoda_prompt_tokens", "Prompt tokens of requests admitted, once a request, prefix-cache hits "
                 "included", "prompt_tokens_total"),
                ("pagoda_generation_tokens", "Tokens generated", "generation_tokens_total"))
    for kind, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
        for name, doc, attr in table:
            if not labelled:
                yield kind(name, doc, value=getattr(replicas[0][1], attr))
                continue
            family = kind(name, doc, labels=labels)
            for replica_id, stats in replicas:
                family.add_metric([replica_id], getattr(stats, attr))
            yield family
    per_tokenizer = CounterMetricFamily("pagoda_tokenizer_requests", "Requests each tokenizer process sent",
                                        labels=["tokenizer", "replica"] if labelled else ["tokenizer"])
    tokenizers: set[str] = set()
    for replica_id, stats in replicas:
        for tokenizer_id, count in zip(stats.tokenizer_ids, stats.tokenizer_requests_total, strict=False):
            per_tokenizer.add_metric([tokenizer_id, replica_id] if labelled else [tokenizer_id], count)
            tokenizers.add(tokenizer_id)
    yield per_tokenizer
    yield GaugeMetricFamily("pagoda_num_tokenizers", "Live tokenizer processes", value=len(tokenizers))
    yield from _tenant_families(replicas, labelled)


def _tenant_families(replicas: list[tuple[str, SchedulerStats]], labelled: bool) -> Iterator[Metric]:
    """The scheduler's per-tenant numbers: sequences waiting and running, and queue time (arrival to first
    admission) as a summary's sum and count."""
    if not any(stats.tenant_names for _, stats in replicas):
        return
    labels = ["tenant", "replica"] if labelled else ["tenant"]
    waiting = GaugeMetricFamily("pagoda_tenant_sequences_waiting", "Sequences waiting, by tenant", labels=labels)
    running = GaugeMetricFamily("pagoda_tenant_sequences_running", "Sequences running, by tenant", labels=labels)
    queue = SummaryMetricFamily("pagoda_tenant_queue_time_seconds", "Time from arrival to first admission by the "
                                "scheduler, by tenant", labels=labels)
    for replica_id, stats in replicas:
        columns = zip(stats.tenant_names, stats.tenant_waiting, stats.tenant_running, stats.tenant_admitted_total,
                      stats.tenant_queue_seconds_total, strict=False)
        for name, num_waiting, num_running, admitted, queued_s in columns:
            values = [name, replica_id] if labelled else [name]
            waiting.add_metric(values, num_waiting)
            running.add_metric(values, num_running)
            queue.add_metric(values, count_value=admitted, sum_value=queued_s)
    yield from (waiting, running, queue)


def _vllm_families(replicas: list[tuple[str, SchedulerStats]], model_name: str,
                   cache_info: dict[str, str]) -> Iterator[Metric]:
    """The scheduler's numbers under vLLM's names: one series per engine (a replica, labelled by its id)."""
    labels = list(VLLM_LABELS)
    gauges = (("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"),
              ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
              ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"))
    counters = (("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                 "prefix_query_tokens_total"),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                 "prefix_hit_tokens_total"),
                ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions_total"),
                ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens_total"),
                ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens_total"))
    for kind, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
        for name, doc, attr in table:
            family = kind(name, doc, labels=labels)
            for engine, stats in replicas:
                family.add_metric([model_name, engine], getattr(stats, attr))
            yield family
    phase_docs = {"queue": "Histogram of time spent in WAITING phase for request.",
                  "prefill": "Histogram of time spent in PREFILL phase for request.",
                  "decode": "Histogram of time spent in DECODE phase for request.",
                  "inference": "Histogram of time spent in RUNNING phase for request."}
    for i, phase in enumerate(REQUEST_PHASES):
        family = HistogramMetricFamily(f"vllm:request_{phase}_time_seconds", phase_docs[phase], labels=labels)
        for engine, stats in replicas:
            if i < len(stats.request_phases):
                _add_buckets(family, [model_name, engine], REQUEST_PHASE_BUCKETS_S, stats.request_phases[i])
        yield family
    steps = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                  labels=labels)
    for engine, stats in replicas:
        if stats.step_tokens is not None:
            _add_buckets(steps, [model_name, engine], STEP_TOKEN_BUCKETS, stats.step_tokens)
    yield steps
    # vLLM's info gauge: always 1, the cache settings in its labels (and no model_name, as vLLM's)
    info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                             labels=[*cache_info, "num_gpu_blocks", "engine"])
    for engine, stats in replicas:
        if stats.kv_blocks_total:  # the worker sized the cache: before that the block count is unknown
            info.add_metric([*cache_info.values(), str(stats.kv_blocks_total), engine], 1)
    yield info


def _add_buckets(family: HistogramMetricFamily, values: list[str], bounds: Sequence[float],
                 histogram: HistogramCounts) -> None:
    if len(histogram.counts) != len(bounds) + 1:
        return  # a peer with other bounds: shown as absent rather than wrong
    cumulative, running = [], 0
    for bound, count in zip([*map(float, bounds), float("inf")], histogram.counts, strict=True):
        running += count
        cumulative.append(("+Inf" if bound == float("inf") else repr(bound), running))
    family.add_metric(values, cumulative, sum_value=histogram.sum)


TALLY_FLUSH_S = 1.0  # the longest a tally keeps observations from the histograms while tokens flow


class ItlTally:
    """Inter-token latencies counted here, over the union of several histograms' bounds, and added to all of them
    in bulk (`flush`): one bisect a token instead of a prometheus_client observation per histogram (each a locked
    bucket scan, ~1.3 us on this project's 2-core host; the second one, vLLM's name, cost the served api ~4.5 us of
    CPU a token on an H100 host: bench/RESULTS.md, fortieth session).

    The histograms are prometheus_client Histogram children: their bucket values are added to through the
    library's own value objects (`_buckets`, `_sum`), which also write the shared files with several api
    processes. Flushed when /metrics or the console reads, when a request ends, and at an observation a second
    after the last flush, so another api process's scrape lags by at most that while tokens flow.
    """

    __slots__ = ("bounds", "counts", "sum", "flushed_at", "_targets")

    def __init__(self, histograms: Sequence[Any]) -> None:
        targets = [(h, tuple(h._upper_bounds[:-1])) for h in histograms]  # the last bound is +Inf
        for histogram, bounds in targets:
            assert len(histogram._buckets) == len(bounds) + 1, "prometheus_client's histogram layout changed"
        self.bounds: tuple[float, ...] = tuple(sorted({b for _, bounds in targets for b in bounds}))
        self.counts = [0] * (len(self.bounds) + 1)  # per union bucket, the last: above every bound
        self.sum = 0.0
        self.flushed_at = 0.0
        # union bucket j (upper bound u) lies inside the target bucket of the first target bound >= u
        self._targets = [(h, [bisect_left(bounds, u) for u in self.bounds] + [len(bounds)]) for h, bounds in targets]

    def observe(self, value: float, now: float, count: int = 1) -> None:
        """`count` observations of `value`."""
        self.counts[bisect_left(self.bounds, value)] += count  # Prometheus' `le`: a value on a bound counts in it
        self.sum += value * count
        if now - self.flushed_at >= TALLY_FLUSH_S:
            self.flush(now)

    def flush(self, now: float) -> None:
        self.flushed_at = now
        if not any(self.counts):
            return
        for histogram, to_target in self._targets:
            per_bucket = [0] * len(histogram._buckets)
            for j, count in enumerate(self.counts):
                per_bucket[to_target[j]] += count
            for value, count in zip(histogram._buckets, per_bucket, strict=True):
                if count:
                    value.inc(count)
            histogram._sum.inc(self.sum)
        self.counts = [0] * len(self.counts)
        self.sum = 0.0


@dataclass(slots=True)
class VllmSeries:
    """One engine's vLLM request series observed in this process (the labelled children, looked up once)."""

    engine: str
    ttft: Any
    itl: ItlTally  # both names' inter-token latency: pagoda's histogram and this engine's vLLM one
    e2e: Any
    n: Any
    success: dict[int, Any]  # FinishReason -> its counter


class ApiMetrics:
    """This process's metrics and the registry /metrics renders."""

    def __init__(self, latest: Callable[[], SchedulerStats | None], per_replica: PerReplica | None = None,
                 model_name: str = "", cache_info: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry()
        multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        if multiprocess:
            # Histogram values live in files every api process writes; the collector sums them all.
            MultiProcessCollector(self.registry)
        own = None if multiprocess else self.registry
        self.ttft = Histogram("pagoda_time_to_first_token_seconds", "Time from HTTP arrival to the first token",
                              buckets=TTFT_BUCKETS_S, registry=own)
        self.itl = Histogram("pagoda_inter_token_latency_seconds", "Time between tokens of one completion",
                             buckets=ITL_BUCKETS_S, registry=own)
        self.e2e = Histogram("pagoda_e2e_request_latency_seconds", "Time from HTTP arrival to the last token",
                             buckets=E2E_BUCKETS_S, registry=own)
        self.http_requests = Counter("pagoda_http_requests", "HTTP requests answered", ["route", "status"],
                                     registry=own)
        # per tenant (a keys file in use): label values are the file's tenant names, a bounded set
        self.tenant_requests = Counter("pagoda_tenant_requests", "Generation requests answered, by tenant and "
                                       "HTTP status", ["tenant", "status"], registry=own)
        self.tenant_prompt_tokens = Counter("pagoda_tenant_prompt_tokens", "Prompt tokens of finished requests",
                                            ["tenant"], registry=own)
        self.tenant_generation_tokens = Counter("pagoda_tenant_generation_tokens", "Tokens generated for finished "
                                                "requests", ["tenant"], registry=own)
        self.tenant_rejections = Counter("pagoda_tenant_rejections", "Requests refused by a tenant's quota "
                                         "(reason: concurrency, requests, tokens, model)", ["tenant", "reason"],
                                         registry=own)
        self.tenant_ttft = Histogram("pagoda_tenant_time_to_first_token_seconds", "Time from HTTP arrival to the "
                                     "first token, by tenant", ["tenant"], buckets=TTFT_BUCKETS_S, registry=own)
        self._latest = latest
        self._per_replica = per_replica
        self._model_name = model_name
        self._own = own
        self._init_vllm(own)
        self.registry.register(SnapshotCollector(latest, per_replica, model_name, cache_info))
        self._files = MultiProcessCollector(None) if multiprocess else None  # every api process's histograms

    def latency_buckets(self) -> dict[str, list[tuple[float, float]]]:
        """TTFT and ITL as cumulative (upper bound, count) pairs: this process's, or with several api processes
        all of theirs (read from the shared files). The console's percentiles over the last minute."""
        self.flush_tallies()
        wanted = {self.ttft._name: "ttft", self.itl._name: "itl"}  # type: ignore[attr-defined]
        families = self._files.collect() if self._files is not None else [*self.ttft.collect(), *self.itl.collect()]
        out: dict[str, list[tuple[float, float]]] = {"ttft": [], "itl": []}
        for family in families:
            key = wanted.get(family.name)
            if key is None:
                continue
            buckets = [(float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket")]
            out[key] = sorted(buckets)
        return out

    def tenant_rejected(self, tenant: str, reason: str) -> None:
        self.tenant_rejections.labels(tenant, reason).inc()

    def tenant_finished(self, tenant: str, status: int, prompt_tokens: int, generation_tokens: int,
                        first_token_s: float | None) -> None:
        self.tenant_requests.labels(tenant, str(status)).inc()
        self.tenant_prompt_tokens.labels(tenant).inc(prompt_tokens)
        self.tenant_generation_tokens.labels(tenant).inc(generation_tokens)
        if first_token_s is not None:
            self.tenant_ttft.labels(tenant).observe(first_token_s)

    # ------------------------------------------------------------------ vLLM's request series

    def _init_vllm(self, own: CollectorRegistry | None) -> None:
        labels = list(VLLM_LABELS)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                   labels, buckets=VLLM_TTFT_BUCKETS_S, registry=own)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                  labels, buckets=VLLM_ITL_BUCKETS_S, registry=own)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                                  labels, buckets=REQUEST_PHASE_BUCKETS_S, registry=own)
        self.vllm_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", labels,
                                buckets=VLLM_N_BUCKETS, registry=own)
        self.vllm_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                    [*labels, "finished_reason"], registry=own)
        # bucketed up to the model's context, which the first snapshot tells (_token_histograms)
        self._vllm_tokens: tuple[Any, Any, Any] | None = None
        self._vllm_series: dict[str, VllmSeries] = {}

    def engine_of(self, tokenizer: bytes) -> str:
        """The engine (replica id) whose scheduler lists this tokenizer: where its requests run."""
        replicas = self._per_replica() if self._per_replica is not None else []
        if len(replicas) <= 1:
            return replicas[0][0] if replicas else "0"
        name = tokenizer.decode(errors="replace")
        return next((replica_id for replica_id, stats in replicas if name in stats.tokenizer_ids), "")

    def vllm_series(self, tokenizer: bytes) -> VllmSeries:
        return self._engine_series(self.engine_of(tokenizer))

    def _engine_series(self, engine: str) -> VllmSeries:
        series = self._vllm_series.get(engine)
        if series is None:
            values = (self._model_name, engine)
            # every finish reason's counter exists at 0 before a request ends, as vLLM's do: rate() needs a prior
            # sample (create_known_series makes them at a scrape, before any request)
            series = VllmSeries(
                engine=engine, ttft=self.vllm_ttft.labels(*values),
                itl=ItlTally([self.itl, self.vllm_itl.labels(*values)]),
                e2e=self.vllm_e2e.labels(*values), n=self.vllm_n.labels(*values),
                success={reason: self.vllm_success.labels(*values, reason.openai_name) for reason in FinishReason})
            if engine:  # "": no replica's snapshot lists the tokenizer yet: looked up again next time
                self._vllm_series[engine] = series
        return series

    def create_known_series(self) -> None:
        """Every engine the snapshots name gets its request series now, at 0 (vLLM makes them at start): made at a
        request's first, they showed its count with no sample before it, which rate() and increase() drop."""
        replicas = self._per_replica() if self._per_replica is not None else []
        engines = [replica_id for replica_id, _ in replicas] or (["0"] if self._latest() is not None else [])
        tokens = self._token_histograms()
        for engine in engines:
            self._engine_series(engine)
            for histogram in tokens or ():
                histogram.labels(self._model_name, engine)

    def _token_histograms(self) -> tuple[Any, Any, Any] | None:
        """vLLM's per-request token histograms, bucketed 1-2-5 up to max_model_len; None until a snapshot tells
        max_model_len (no request finishes before one does)."""
        if self._vllm_tokens is None:
            stats = self._latest()
            if stats is None or stats.max_model_len <= 0:
                return None
            buckets = buckets_1_2_5(stats.max_model_len)
            labels = list(VLLM_LABELS)
            self._vllm_tokens = (
                Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels,
                          buckets=buckets, registry=self._own),
                Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", labels,
                          buckets=buckets, registry=self._own),
                Histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", labels,
                          buckets=buckets, registry=self._own))
        return self._vllm_tokens

    def vllm_finished(self, gen: Generation, max_tokens: int | None) -> None:
        """A generation request ended: vLLM counts each completion (its n of them, each prompt's) as a request that
        finished with its reason. One the client left or the server cut short (a timeout) counts as abort, as vLLM
        counts a request aborted on disconnect; one whose prompt failed in the engine as error. A request refused
        (before every prompt was admitted, or by a 4xx after, as a grammar that cannot compile) counts nowhere: vLLM
        refuses those before its engine sees them."""
        gen.vllm.itl.flush(time.monotonic())
        if gen.accepted_at is None or gen.refused:
            return
        series = gen.vllm
        tokens = self._token_histograms()
        max_model_len = stats.max_model_len if (stats := self._latest()) is not None else 0
        for _ in range(len(gen.num_prompt_tokens)):
            series.n.observe(gen.n)
        for choice, reason in zip(gen.choices, gen.final_reasons(), strict=True):
            series.success[reason if reason in series.success else FinishReason.ERROR].inc()
            if tokens is None:
                continue
            prompt, generation, limit = (h.labels(self._model_name, series.engine) for h in tokens)
            prompt.observe(choice.num_prompt_tokens)
            generation.observe(choice.num_tokens)
            # vLLM's server fills an absent max_tokens with what the context leaves; pagoda's None means the same
            limit.observe(max_tokens if max_tokens is not None else max(0, max_model_len - choice.num_prompt_tokens))

    def flush_tallies(self) -> None:
        """This process's tallied observations into its histograms (a series not cached yet flushes when its
        request ends)."""
        now = time.monotonic()
        for series in self._vllm_series.values():
            series.itl.flush(now)

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition body and its content type, in the format the scraper asked for."""
        self.create_known_series()
        self.flush_tallies()
        encoder, content_type = _choose_encoder(accept or "")
        return encoder(self.registry), content_type


def _choose_encoder(accept: str) -> tuple[Callable[[CollectorRegistry], bytes], str]:
    """prometheus_client's choice, less its OpenMetrics underscores escaping (what Prometheus 2.x gets: it names no
    escaping), which writes each sample's name by the label-name rules, so `vllm:num_requests_running` went out as
    `vllm_num_requests_running` under a `# TYPE vllm:num_requests_running` line (client_python#1177). Every name
    served here is a legacy one (a colon is a legal metric-name character), which that escaping leaves as it is: the
    body is written unescaped, its content type still says underscores."""
    encoder, content_type = choose_encoder(accept)
    if (isinstance(encoder, partial) and encoder.func is openmetrics_exposition.generate_latest
            and encoder.keywords.get("escaping") == openmetrics_exposition.UNDERSCORES):
        encoder = partial(encoder, escaping=openmetrics_exposition.ALLOWUTF8)
    return encoder, content_type
