"""`/metrics` and `/v1/status`'s client counts for every gateway worker of a port.

With `gateway.workers: N` a scrape through the port reaches one of N processes
(SO_REUSEPORT), each with its own counters. So that any of them answers for all:

- Every worker listens on a private Unix socket, `{folder}/{index}.sock`, in a folder
  worker 0 creates with mode 0700 (only this user reaches it); the folder travels to the
  others inside the pickled `WorkerSpec` on their stdin, never in argv or the
  environment. A request is one word on a line; the answer is everything until EOF.
- Worker 0 sums. On a scrape it asks every other worker for a snapshot of its
  `babelcast_*` samples (`snapshot`: JSON, far cheaper to read back than the text
  format; all at once, `CHILD_TIMEOUT_S` each), adds samples of identical name and labels
  to its own (counters, gauges such as the client counts, histogram buckets, `_sum` and
  `_count`), and renders the result through prometheus_client's own exposition (a
  collector on a throwaway registry), so the format is the library's. A scrape that lands
  on another worker asks worker 0 (`metrics`) and serves its text as is.
- Why worker 0 alone sums: what Prometheus reads of a counter must never go down, or
  `rate()` takes the drop for a reset and counts the whole remaining total as one
  interval's increase. A worker that dies takes its counters with it; worker 0 keeps each
  worker's last answered counter and histogram samples, and when a worker answers as a new
  process (its incarnation changed) the old process's last figures join a retired base
  that stays in the sum. A worker that does not answer in time keeps its counters at
  their last values and its gauges are left out; `babelcast_gateway_workers_scraped`
  below `babelcast_gateway_workers` shows it. Were each worker to sum for itself, each
  would carry different figures, and scrapes landing on different workers would disagree.
  Aggregations run one at a time, so a slower one cannot serve figures older than one
  already served.
- Gauges only worker 0 sets (placement, `babelcast_actor_up`, the YouTube backlog: the
  orchestrator runs in worker 0 alone) have no samples elsewhere, or a 0 when unlabelled,
  so the sum is worker 0's value. `babelcast_gateway_workers` and `..._scraped` describe
  the scrape, so only worker 0's count. Families outside `babelcast_*` (`process_*`,
  `python_*`) are worker 0's, whoever answers: the process that runs the event.
- When worker 0 does not answer another worker within `AGGREGATE_TIMEOUT_S`, that scrape
  fails (503): Prometheus records it as down rather than a partial total that reads as a
  counter reset.

`/v1/status` asks the same way (`clients`: the summed `babelcast_gateway_clients`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from orchestrator import metrics

log = logging.getLogger(__name__)

CHILD_TIMEOUT_S = 2.0
"""How long worker 0 waits for another worker's snapshot: a busy worker's loop lags
0.2-0.3 s at 2,000 clients (bench.delivery); one stopped or dead does not hold a scrape
(Prometheus gives up after 10 s by default)."""
AGGREGATE_TIMEOUT_S = 6.0
"""How long a worker waits for worker 0's sum: one aggregation may be ahead of it."""
REQUEST_TIMEOUT_S = 2.0
MAX_REPLY_BYTES = 64 << 20
OURS = "babelcast_"
PER_SCRAPE = frozenset({"babelcast_gateway_workers", "babelcast_gateway_workers_scraped"})
"""Families that describe the scrape itself: worker 0's values only."""
CUMULATIVE = frozenset({"counter", "histogram"})
INCARNATION = f"{os.getpid()}-{time.time_ns()}"
"""This process, as opposed to an earlier one of the same worker index."""

Labels = tuple[tuple[str, str], ...]
SampleKey = tuple[str, Labels]
"""A sample's name (with `_total`, `_bucket`, ...) and its labels."""


@dataclass(frozen=True)
class WorkerGroup:
    """Where the gateway workers of one port reach each other (picklable)."""

    folder: str
    count: int

    def path(self, index: int) -> str:
        return os.path.join(self.folder, f"{index}.sock")

    @classmethod
    def create(cls, count: int) -> WorkerGroup:
        """A fresh folder, mode 0700 (`mkdtemp`). A Unix socket path holds at most 107
        bytes: where the temporary folder's path is too long, /tmp."""
        parent = tempfile.gettempdir()
        if len(parent) > 60:
            parent = "/tmp"
        return cls(tempfile.mkdtemp(prefix="babelcast-gw-", dir=parent), count)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


# ---- the socket -----------------------------------------------------------------------
async def ask(path: str, request: str, timeout_s: float) -> bytes | None:
    """The answer of the worker at `path` to `request`; None when it is not there, closes
    without a word, or is not done within `timeout_s`."""
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_unix_connection(path)
            try:
                writer.write(request.encode() + b"\n")
                await writer.drain()
                while chunk := await reader.read(1 << 16):
                    size += len(chunk)
                    if size > MAX_REPLY_BYTES:
                        return None
                    chunks.append(chunk)
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
    except (OSError, TimeoutError):
        return None
    return b"".join(chunks) or None


Handler = Callable[[], Awaitable[bytes]]


async def serve(path: str, handlers: dict[str, Handler]) -> asyncio.AbstractServer:
    """Answer `handlers`' requests on a Unix socket at `path` (a stale one, from the
    process this one replaces, is removed first)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                line = await reader.readline()
            handler = handlers.get(line.decode(errors="replace").strip())
            if handler is not None:
                writer.write(await handler())
                await writer.drain()
        except Exception as exc:  # the asker sees EOF with nothing: it counts us missing
            log.warning("metrics request failed: %s", type(exc).__name__)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return await asyncio.start_unix_server(answer, path=path)


# ---- what a worker says ---------------------------------------------------------------
def snapshot(families: Iterable[Metric]) -> bytes:
    """This process's `babelcast_*` samples (those describing a scrape left out)."""
    out = [[f.name, f.type, [[s.name, list(s.labels.items()), s.value] for s in f.samples]]
           for f in families if f.name.startswith(OURS) and f.name not in PER_SCRAPE]
    return json.dumps({"incarnation": INCARNATION, "families": out}).encode()


@dataclass
class Answer:
    incarnation: str
    samples: dict[str, dict[SampleKey, float]]
    """family name → (sample name, labels) → value"""


def read_snapshot(data: bytes) -> Answer | None:
    try:
        body = json.loads(data)
        samples: dict[str, dict[SampleKey, float]] = {}
        for name, _kind, rows in body["families"]:
            family = samples.setdefault(str(name), {})
            for sample, labels, value in rows:
                key = (str(sample), tuple((str(k), str(v)) for k, v in labels))
                family[key] = float(value)
        return Answer(str(body["incarnation"]), samples)
    except (ValueError, TypeError, KeyError):
        return None


# ---- worker 0's sum -------------------------------------------------------------------
@dataclass
class _Seen:
    """What worker 0 knows of another worker."""

    incarnation: str = ""
    last: dict[str, dict[SampleKey, float]] = field(default_factory=dict)
    """Its counter and histogram samples as it last answered."""
    retired: dict[str, dict[SampleKey, float]] = field(default_factory=dict)
    """The last figures of its earlier processes, summed."""


def _add(into: dict[str, dict[SampleKey, float]],
         samples: dict[str, dict[SampleKey, float]]) -> None:
    for name, family in samples.items():
        target = into.setdefault(name, {})
        for key, value in family.items():
            target[key] = target.get(key, 0.0) + value


@dataclass
class Merged:
    families: list[Metric]
    count: int
    answered: int

    def exposition(self) -> bytes:
        families = self.families

        class Collector:
            def collect(self) -> Iterable[Metric]:
                return families

        registry = CollectorRegistry()
        registry.register(Collector())
        return generate_latest(registry)

    def clients(self) -> collections.Counter[tuple[str, str]]:
        out: collections.Counter[tuple[str, str]] = collections.Counter()
        for f in self.families:
            if f.name == "babelcast_gateway_clients":
                for s in f.samples:
                    out[(s.labels["stream"], s.labels["lang"])] += int(s.value)
        return out


class Aggregator:
    """Worker 0's view of the others (see the module's doc for the sums)."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group
        self._seen = {i: _Seen() for i in range(1, group.count)}
        self._lock = asyncio.Lock()

    async def merged(self) -> Merged:
        async with self._lock:
            replies = await asyncio.gather(*(ask(self.group.path(i), "snapshot",
                                                 CHILD_TIMEOUT_S) for i in self._seen))
            return await asyncio.to_thread(self._merge, dict(zip(self._seen, replies,
                                                                 strict=True)))

    def _merge(self, replies: dict[int, bytes | None]) -> Merged:
        answers = {i: read_snapshot(r) if r is not None else None for i, r in replies.items()}
        answered = 1 + sum(a is not None for a in answers.values())
        metrics.GATEWAY_WORKERS.set(self.group.count)
        metrics.GATEWAY_WORKERS_SCRAPED.set(answered)
        own = list(REGISTRY.collect())
        kinds = {f.name: f.type for f in own if f.name.startswith(OURS)}
        totals: dict[str, dict[SampleKey, float]] = {}
        for f in own:
            if f.name in kinds:
                _add(totals, {f.name: {(s.name, tuple(s.labels.items())): s.value
                                       for s in f.samples}})
        for index, seen in self._seen.items():
            answer = answers[index]
            if answer is not None:
                known = {n: s for n, s in answer.samples.items()
                         if n in kinds and n not in PER_SCRAPE}
                if answer.incarnation != seen.incarnation:
                    if seen.incarnation:
                        log.info("gateway worker %d is a new process: its predecessor's "
                                 "counters stay in /metrics", index)
                    _add(seen.retired, seen.last)
                    seen.incarnation = answer.incarnation
                seen.last = {n: s for n, s in known.items() if kinds[n] in CUMULATIVE}
                _add(totals, known)
            else:
                _add(totals, seen.last)
            _add(totals, seen.retired)
        out: list[Metric] = []
        for f in own:
            if f.name not in kinds:
                out.append(f)
                continue
            merged = Metric(f.name, f.documentation, f.type, f.unit)
            for (sample, labels), value in totals.get(f.name, {}).items():
                merged.add_sample(sample, dict(labels), value)
            out.append(merged)
        return Merged(out, self.group.count, answered)


# ---- what the app uses ----------------------------------------------------------------
class GatewayMetrics:
    """The figures `/metrics` and `/v1/status` serve: this process's alone (`group`
    None: a single gateway process), or the sum over its group of workers."""

    def __init__(self, group: WorkerGroup | None, index: int) -> None:
        self.group = group
        self.index = index
        self._aggregator = Aggregator(group) if group is not None and index == 0 else None
        self._server: asyncio.AbstractServer | None = None
        self._parent = os.getppid()

    async def start(self) -> None:
        if self.group is None:
            return
        handlers: dict[str, Handler]
        if self._aggregator is not None:
            aggregator = self._aggregator
            handlers = {"metrics": self._exposition_bytes,
                        "clients": lambda: self._clients_json(aggregator)}
        else:
            handlers = {"snapshot": lambda: asyncio.to_thread(
                lambda: snapshot(REGISTRY.collect()))}
        self._server = await serve(self.group.path(self.index), handlers)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
            if self.group is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.group.path(self.index))
                if self.index > 0 and os.getppid() != self._parent:
                    # Worker 0 died without cleaning up (SIGKILL): its children stop on
                    # their parent-death signal, and they take the folder away.
                    self.group.remove()

    async def _exposition_bytes(self) -> bytes:
        assert self._aggregator is not None
        merged = await self._aggregator.merged()
        return await asyncio.to_thread(merged.exposition)

    @staticmethod
    async def _clients_json(aggregator: Aggregator) -> bytes:
        merged = await aggregator.merged()
        return json.dumps({"clients": [[s, lang, n] for (s, lang), n in
                                       merged.clients().items()],
                           "count": merged.count, "answered": merged.answered}).encode()

    async def exposition(self) -> bytes | None:
        """What `/metrics` serves; None when worker 0 did not answer in time."""
        if self.group is None:
            metrics.GATEWAY_WORKERS.set(1)
            metrics.GATEWAY_WORKERS_SCRAPED.set(1)
            return generate_latest()
        if self._aggregator is not None:
            return await self._exposition_bytes()
        return await ask(self.group.path(0), "metrics", AGGREGATE_TIMEOUT_S)

    async def clients(self, own: collections.Counter[tuple[str, str]]
                      ) -> tuple[collections.Counter[tuple[str, str]], int, int]:
        """Caption clients by (stream, lang) over the group, the group's size and how many
        of it were counted; `own` (this process's) alone when worker 0 does not answer."""
        if self.group is None:
            return own, 1, 1
        if self._aggregator is not None:
            merged = await self._aggregator.merged()
            return merged.clients(), merged.count, merged.answered
        data = await ask(self.group.path(0), "clients", AGGREGATE_TIMEOUT_S)
        try:
            body: dict[str, Any] = json.loads(data or b"")
            counts = collections.Counter({(str(s), str(lang)): int(n)
                                          for s, lang, n in body["clients"]})
            return counts, int(body["count"]), int(body["answered"])
        except (ValueError, TypeError, KeyError):
            return own, self.group.count, 1
