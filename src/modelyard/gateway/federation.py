"""The replicas' own metrics, gathered by the gateway and re-exposed on its /metrics.

Each ready replica (an LLM worker, or the shared encoder host) answers `GET /metrics` on its
loopback port. On a scrape of the gateway they are all read at once, each within a short
timeout; one that does not answer in time is skipped and counted
(`modelyard_federation_errors_total`), never failing the scrape. Every series gets the labels of
what it belongs to (`endpoint`, `replica`, `version`, `tenant` = the endpoint's owner,
`model_name` = the public model name) in place of the worker's own `model` label. The encoder
host serves many endpoints: its series are told apart by their `model` label (the endpoint's
name on the host); the host's own series (memory, evictions) get only `replica`.

The result is kept for `cache_s`, so several Prometheus servers (or an impatient one) scraping
the gateway do not multiply the load on the replicas.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SeriesOwner:
    """The endpoint a replica's series belong to, as labels."""

    endpoint: str
    tenant: str
    model_name: str
    version: str = ""

    def labels(self, replica: str) -> dict[str, str]:
        return {
            "endpoint": self.endpoint,
            "replica": replica,
            "version": self.version,
            "tenant": self.tenant,
            "model_name": self.model_name,
        }


@dataclass(frozen=True)
class ScrapeTarget:
    """One replica process to read. `owners` maps the worker's `model` label to the endpoint:
    an LLM worker serves one endpoint (the key None: every series); the encoder host one per
    model it hosts."""

    url: str
    replica: str
    owners: Mapping[str | None, SeriesOwner] = field(default_factory=dict)


class Federation:
    def __init__(
        self, timeout_s: float = 1.0, cache_s: float = 1.5, headers: dict[str, str] | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self.headers = headers or {}  # the token the replicas demand
        self.cache_s = cache_s
        self.errors: Counter[str] = Counter()  # replica -> scrapes that failed
        self._cached: tuple[float, list[Metric]] | None = None
        self._lock = asyncio.Lock()

    async def collect(self, targets: Iterable[ScrapeTarget]) -> list[Metric]:
        """The replicas' series, relabelled and merged by name, plus the error counter.

        Served from the cache when it is younger than `cache_s`; concurrent callers share one
        round of scrapes."""
        async with self._lock:
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] >= self.cache_s:
                self._cached = (now, await self._scrape(_merge_targets(targets)))
            families = self._cached[1]
        errors = CounterMetricFamily(
            "modelyard_federation_errors",
            "Scrapes of a replica's /metrics that failed or timed out (the replica was skipped).",
            labels=["replica"],
        )
        for replica, n in sorted(self.errors.items()):
            errors.add_metric([replica], n)
        return [*families, errors]

    async def _scrape(self, targets: list[ScrapeTarget]) -> list[Metric]:
        if not targets:
            return []
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers) as client:
            texts = await asyncio.gather(*(self._read(client, t) for t in targets))
        # Parsing many replicas' text is CPU work: off the event loop that relays requests.
        return await asyncio.to_thread(_merge, targets, texts)

    async def _read(self, client: httpx.AsyncClient, target: ScrapeTarget) -> str | None:
        try:
            # The whole answer within the timeout (httpx's bounds each read, not the sum).
            async with asyncio.timeout(self.timeout_s):
                response = await client.get(f"{target.url}/metrics")
            response.raise_for_status()
            return response.text
        except (httpx.HTTPError, OSError, TimeoutError) as exc:
            self.errors[target.replica] += 1
            log.warning("metrics of replica %s skipped: %r", target.replica, exc)
            return None


def _merge_targets(targets: Iterable[ScrapeTarget]) -> list[ScrapeTarget]:
    """One target per process: the encoder host is listed once per endpoint it serves."""
    by_url: dict[str, ScrapeTarget] = {}
    for t in targets:
        seen = by_url.get(t.url)
        if seen is None:
            by_url[t.url] = t
        else:
            by_url[t.url] = ScrapeTarget(t.url, seen.replica, {**seen.owners, **t.owners})
    return list(by_url.values())


def _merge(targets: list[ScrapeTarget], texts: list[str | None]) -> list[Metric]:
    merged: dict[str, Metric] = {}
    for target, text in zip(targets, texts, strict=True):
        if text is not None:
            _relabel_into(merged, target, text)
    return list(merged.values())


def _relabel_into(merged: dict[str, Metric], target: ScrapeTarget, text: str) -> None:
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:  # a replica's bad exposition costs only its own series
        log.warning("metrics of replica %s unreadable: %s", target.replica, exc)
        return
    every = target.owners.get(None)
    for family in families:
        if family.name.endswith("_created"):
            continue  # creation timestamps: noise once merged over replicas
        out = merged.get(family.name)
        if out is None:
            out = merged[family.name] = Metric(family.name, family.documentation, family.type)
        for s in family.samples:
            labels = dict(s.labels)
            model = labels.pop("model", None)
            labels.pop("model_name", None)
            owner = every or (target.owners.get(model) if model is not None else None)
            if owner is not None:
                labels.update(owner.labels(target.replica))
            elif model is not None:
                continue  # a model the host still holds for an endpoint that is gone
            else:
                labels["replica"] = target.replica  # the process's own series
            out.samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))
