"""Prometheus metrics: latency histograms observed here, scheduler numbers from its latest snapshot."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from pagoda.shared.messages import SchedulerStats

# prometheus_client picks its value storage from this variable when first imported; the launcher sets it
# (for api_workers > 1) before this process starts, and we only mirror prometheus_client's own choice.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                 240.0, 480.0, 960.0, 1920.0)


PerReplica = Callable[[], list[tuple[str, SchedulerStats]]]


class SnapshotCollector:
    """Scheduler gauges and counters read from the latest snapshot at scrape time.

    Every api process sees the same snapshot, so these are never summed across processes. With several
    engine replicas (per_replica lists more than one) each series carries a `replica` label instead.
    """

    def __init__(self, latest: Callable[[], SchedulerStats | None], per_replica: PerReplica | None = None) -> None:
        self._latest = latest
        self._per_replica = per_replica

    def collect(self) -> Iterator[Metric]:
        replicas = self._per_replica() if self._per_replica is not None else []
        if self._per_replica is not None and (len(replicas) > 1 or (replicas and replicas[0][0] != "0")):
            yield from _families(replicas, labelled=True)
            return
        stats = self._latest()
        if stats is None:
            return  # nothing known yet: absent, not a fake zero
        yield from _families([("", stats)], labelled=False)


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
                ("pagoda_prompt_tokens", "Prompt tokens computed", "prompt_tokens_total"),
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


class ApiMetrics:
    """This process's metrics and the registry /metrics renders."""

    def __init__(self, latest: Callable[[], SchedulerStats | None], per_replica: PerReplica | None = None) -> None:
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
        self.registry.register(SnapshotCollector(latest, per_replica))
        self._files = MultiProcessCollector(None) if multiprocess else None  # every api process's histograms

    def latency_buckets(self) -> dict[str, list[tuple[float, float]]]:
        """TTFT and ITL as cumulative (upper bound, count) pairs: this process's, or with several api processes
        all of theirs (read from the shared files). The console's percentiles over the last minute."""
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

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition body and its content type, in the format the scraper asked for."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
