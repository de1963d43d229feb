"""Several gateway processes on one port (`gateway.workers`), as `babelcast gateway`
starts them: real processes, a real redis-server, real WebSocket clients. Captions are
published into Redis as an ASR actor publishes them (XADD + PUBLISH); the gateway alone
delivers them, so these tests need no Ray and no engine. `/metrics` and `/v1/status`,
whichever worker answers, count every worker (orchestrator/gateway/metrics_merge.py)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from redis.asyncio import Redis
from websockets.asyncio.client import ClientConnection, connect

from orchestrator.config import AUTO_GATEWAY_WORKERS_MAX, GatewayConfig, cgroup_cpu_limit
from orchestrator.gateway.publish import PUBLISHER_GRACE_S
from orchestrator.gateway.publishers import lease_key
from orchestrator.redis_server import free_port
from workers.bus import RedisBus
from workers.events import CaptionSegment

pytestmark = pytest.mark.integration

ADMIN, PUBLISH = "admin-" + "a" * 32, "publish-" + "p" * 32
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
WORKER = "x-babelcast-worker"
RECV_S = 10.0


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    base: str
    log: Path
    folder: Path | None = None
    """Its workers' private metric socket folder."""

    @property
    def ws(self) -> str:
        return self.base.replace("http://", "ws://")

    def worker_pids(self) -> set[int]:
        pids: set[int] = set()
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                with (task / "children").open() as f:
                    pids |= {int(p) for p in f.read().split()}
            except FileNotFoundError:  # that thread ended since the listing
                continue
        return pids


def metric_folders(under: Path) -> set[Path]:
    """The gateway workers' private metric socket folders (metrics_merge.WorkerGroup)
    under the temporary folder `under`: the gateway under test is given a private one
    (TMPDIR), since the suite's other worker starts gateways of its own in /tmp."""
    return set(under.glob("babelcast-gw-*"))


def _stacks(pid: int) -> str:
    """Where a hung process is (py-spy, installed with the test tools), for the failure
    message; what py-spy said when it cannot read it."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return "(py-spy not installed)"
    try:
        done = subprocess.run([str(spy), "dump", "--pid", str(pid)], capture_output=True,
                              text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return "(py-spy dump did not answer in 30 s)"
    return (done.stdout + done.stderr)[-6000:]


@pytest.fixture
def gateway(redis_url: str, tmp_path: Path) -> Iterator[Gateway]:
    # Short: a Unix socket path holds at most 107 bytes (WorkerGroup.create falls back
    # to /tmp when TMPDIR is longer than 60).
    tmp = Path(tempfile.mkdtemp(prefix="bcgw-", dir="/tmp"))
    folders_before = metric_folders(tmp)
    port = free_port()
    cfg = tmp_path / "event.yaml"
    cfg.write_text(f"""
event: workers
redis: {{url: "{redis_url}"}}
streams:
  - {{id: room, source: push, language: en}}
auth:
  admin_token_env: T_ADMIN
  publish_token_env: {{room: T_PUBLISH}}
  viewers: public
gateway: {{host: 127.0.0.1, port: {port}, workers: 2}}
""")
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "gateway", str(cfg)], stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "T_ADMIN": ADMIN, "T_PUBLISH": PUBLISH,
                 "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)})
    gw = Gateway(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 60
    # `print`ed once worker 0 listens and every other worker said it is ready.
    while b"Ctrl-C stops it" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"babelcast gateway did not start: {log.read_text()[-3000:]}")
        time.sleep(0.1)
    new = metric_folders(tmp) - folders_before
    assert len(new) == 1, new
    (gw.folder,) = new
    try:
        yield gw
    finally:
        workers = gw.worker_pids() if proc.poll() is None else set()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            stacks = _stacks(proc.pid)
            proc.kill()
            pytest.fail("babelcast gateway did not stop on SIGINT; its log:\n"
                        f"{log.read_text()[-3000:]}\nits stacks:\n{stacks}")
        assert proc.returncode == 0, log.read_text()[-3000:]
        assert not [p for p in workers if Path(f"/proc/{p}").exists()
                    and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]], \
            "a gateway worker outlived its parent"
        assert metric_folders(tmp) <= folders_before, "the metric socket folder was left"
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


def caption(seq: int) -> CaptionSegment:
    now = time.time()
    final = seq % 5 == 0
    return CaptionSegment(stream="room", lang="en", segment_id=(seq - 1) // 5, seq=seq,
                          revision=(seq - 1) % 5, is_final=final, text=f"words {seq}",
                          stable_prefix_len=0, lines=(f"words {seq}",),
                          audio_start_s=0.0, audio_end_s=seq * 0.1, audio_end_wall=now,
                          emit_time=now)


async def publish(redis: Redis, first: int, last: int, per_s: float) -> None:
    bus = RedisBus(redis)
    for seq in range(first, last + 1):
        await bus.publish_caption(caption(seq))
        await asyncio.sleep(1 / per_s)


@dataclass
class Viewer:
    """A caption client that resumes with `since` after a drop, as the overlay does."""

    worker: str = ""
    seqs: list[int] = field(default_factory=list)
    workers_seen: list[str] = field(default_factory=list)
    reconnects: int = 0


async def open_viewer(gw: Gateway, since: int) -> tuple[ClientConnection, str]:
    ws = await connect(f"{gw.ws}/v1/streams/room/captions?lang=en&since={since}",
                       open_timeout=RECV_S)
    assert ws.response is not None
    return ws, ws.response.headers[WORKER]


async def viewers_on_both_workers(gw: Gateway, each: int, since: int = 0
                                  ) -> list[tuple[Viewer, ClientConnection]]:
    """Connect until `each` clients are on each worker (the kernel spreads connections
    by their address hash, so a few more connections than 2 × each are made)."""
    by_worker: dict[str, list[tuple[Viewer, ClientConnection]]] = {"0": [], "1": []}
    extra: list[ClientConnection] = []
    for _ in range(40):
        if all(len(v) >= each for v in by_worker.values()):
            break
        ws, worker = await open_viewer(gw, since)
        if len(by_worker[worker]) >= each:
            extra.append(ws)
            continue
        by_worker[worker].append((Viewer(worker, workers_seen=[worker]), ws))
    for ws in extra:
        await ws.close()
    assert all(len(v) >= each for v in by_worker.values()), \
        {k: len(v) for k, v in by_worker.items()}
    return [pair for pairs in by_worker.values() for pair in pairs]


async def follow(gw: Gateway, viewer: Viewer, ws: ClientConnection, last_seq: int) -> None:
    """Read captions until `last_seq`; after a drop, reconnect with since=the last seq."""
    while True:
        try:
            while not viewer.seqs or viewer.seqs[-1] < last_seq:
                msg = json.loads(await asyncio.wait_for(ws.recv(), RECV_S))
                assert msg["type"] == "caption", msg
                viewer.seqs.append(msg["seq"])
            await ws.close()
            return
        except (websockets.ConnectionClosed, OSError):
            viewer.reconnects += 1
            since = viewer.seqs[-1] if viewer.seqs else 0
            for _ in range(50):
                try:
                    ws, worker = await open_viewer(gw, since)
                except (OSError, websockets.InvalidHandshake, TimeoutError):
                    await asyncio.sleep(0.1)  # the port is shared: the next try lands live
                    continue
                viewer.workers_seen.append(worker)
                break
            else:
                pytest.fail("no worker took the reconnect")


async def deliver(gateway: Gateway, redis: Redis, pairs: list[tuple[Viewer, ClientConnection]],
                  last: int) -> None:
    """Publish seq 1..`last` (200/s) while every viewer follows them to the end."""
    readers = [asyncio.create_task(follow(gateway, v, ws, last)) for v, ws in pairs]
    await publish(redis, 1, last, per_s=200)
    await asyncio.wait_for(asyncio.gather(*readers), 30)

async def test_two_workers_on_one_port_deliver_every_caption_once_to_each_client(
        gateway: Gateway, redis: Redis) -> None:
    pairs = await viewers_on_both_workers(gateway, 2)
    await deliver(gateway, redis, pairs, 60)
    for viewer, _ in pairs:
        assert viewer.seqs == list(range(1, 61)), (viewer.worker, viewer.seqs)
        assert viewer.reconnects == 0


async def test_a_killed_worker_s_clients_resume_with_since_and_it_is_started_again(
        gateway: Gateway, redis: Redis) -> None:
    pairs = await viewers_on_both_workers(gateway, 2)
    before = gateway.worker_pids()
    assert len(before) == 1, before  # worker 0 is the `babelcast gateway` process itself
    (victim,) = before
    last = 300
    readers = [asyncio.create_task(follow(gateway, v, ws, last)) for v, ws in pairs]
    publisher = asyncio.create_task(publish(redis, 1, last, per_s=150))
    await asyncio.sleep(0.6)  # mid-stream: ~90 captions out, ~210 to come
    os.kill(victim, signal.SIGKILL)
    await asyncio.wait_for(publisher, 30)
    await asyncio.wait_for(asyncio.gather(*readers), 30)
    for viewer, _ in pairs:
        assert viewer.seqs == list(range(1, last + 1)), (viewer.worker, viewer.seqs)
    killed = [v for v, _ in pairs if v.worker == "1"]
    assert all(v.reconnects >= 1 for v in killed), [v.reconnects for v, _ in pairs]
    assert all(v.reconnects == 0 for v, _ in pairs if v.worker == "0")
    # The parent starts worker 1 again: a new process, taking connections on the port.
    deadline = time.monotonic() + 20
    while not (gateway.worker_pids() - before):
        assert time.monotonic() < deadline, "the killed worker was not started again"
        await asyncio.sleep(0.2)
    # The new process takes connections once it has started listening, which under load
    # (a 2-core CI running the suite) came after 30 back-to-back tries had all gone to
    # worker 0; so it gets the same 20 s as its start.
    seen = set()
    deadline = time.monotonic() + 20
    while seen != {"0", "1"} and time.monotonic() < deadline:
        ws, worker = await open_viewer(gateway, 0)
        await ws.close()
        seen.add(worker)
        if worker == "0":
            await asyncio.sleep(0.1)
    assert seen == {"0", "1"}
    assert "gateway worker 1" in gateway.log.read_text()


Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class Scrape:
    worker: str
    series: Series

    def total(self, name: str, **labels: str) -> float:
        """The sum of `name`'s series that carry `labels`."""
        return sum(v for (n, ls), v in self.series.items()
                   if n == name and set(labels.items()) <= ls)


async def scrape(gw: Gateway) -> Scrape:
    """`/metrics` through the port, on a new connection (so any worker may answer). A
    worker that is stopped still takes connections (the kernel completes them): one that
    does not answer is given up on and the next connection tried."""
    for _ in range(20):
        async with httpx.AsyncClient(timeout=6.0) as http:
            try:
                resp = await http.get(f"{gw.base}/metrics", headers=AS_ADMIN)
            except httpx.TimeoutException:
                continue
        assert resp.status_code == 200, resp.text
        series = {(s.name, frozenset(s.labels.items())): s.value
                  for f in text_string_to_metric_families(resp.text) for s in f.samples}
        return Scrape(resp.headers[WORKER], series)
    pytest.fail("no worker answered /metrics")


async def scrape_each_worker(gw: Gateway) -> dict[str, Scrape]:
    """A scrape answered by each worker."""
    by: dict[str, Scrape] = {}
    for _ in range(40):
        got = await scrape(gw)
        by.setdefault(got.worker, got)
        if set(by) == {"0", "1"}:
            return by
    pytest.fail(f"/metrics was answered by workers {sorted(by)} only")


async def scrape_until(gw: Gateway, ok: Callable[[Scrape], bool], what: str) -> Scrape:
    deadline = time.monotonic() + 30
    while True:
        got = await scrape(gw)
        if ok(got):
            return got
        assert time.monotonic() < deadline, f"{what}: {got.series}"
        await asyncio.sleep(0.1)


CLIENTS, SENT = "babelcast_gateway_clients", "babelcast_gateway_messages_total"
DELIVERED = "babelcast_gateway_caption_delivery_seconds_count"
WORKERS, SCRAPED = "babelcast_gateway_workers", "babelcast_gateway_workers_scraped"


async def test_metrics_and_status_through_the_port_count_every_worker(
        gateway: Gateway, redis: Redis) -> None:
    assert gateway.folder is not None and gateway.folder.stat().st_mode & 0o777 == 0o700
    assert {p.name for p in gateway.folder.iterdir()} == {"0.sock", "1.sock"}
    pairs = await viewers_on_both_workers(gateway, 2)
    viewers = len(pairs)
    # Connected clients, on whichever worker answers the scrape: all of them.
    await scrape_until(gateway, lambda m: m.total(CLIENTS, stream="room") == viewers,
                       "the clients of both workers")
    for worker, got in (await scrape_each_worker(gateway)).items():
        assert got.total(CLIENTS, stream="room", lang="en") == viewers, worker
        assert got.total(WORKERS) == 2 and got.total(SCRAPED) == 2, worker
    async with httpx.AsyncClient(timeout=10) as http:
        answered = set()
        for _ in range(40):
            resp = await http.get(f"{gateway.base}/v1/status", headers={
                **AS_ADMIN, "Connection": "close"})
            body = resp.json()["clients"]
            assert body["total"] == viewers and body["by_stream"] == {"room": {"en": viewers}}
            assert body["gateway_workers"] == {"count": 2, "counted": 2}
            answered.add(resp.headers[WORKER])
            if answered == {"0", "1"}:
                break
        assert answered == {"0", "1"}

    await deliver(gateway, redis, pairs, 40)
    assert all(v.seqs == list(range(1, 41)) for v, _ in pairs)
    # What both workers sent, counted once, whichever answers; the clients have left.
    await scrape_until(gateway, lambda m: m.total(CLIENTS) == 0, "the clients to leave")
    for worker, got in (await scrape_each_worker(gateway)).items():
        assert got.total(SENT, stream="room", lang="en") == 40 * viewers, worker
        assert got.total(DELIVERED, stream="room") == 40 * viewers, worker
        assert got.total("babelcast_gateway_caption_delivery_seconds_bucket",
                         stream="room", le="+Inf") == 40 * viewers, worker


async def test_a_worker_that_stops_answering_or_dies_leaves_the_scrape_whole(
        gateway: Gateway, redis: Redis) -> None:
    pairs = await viewers_on_both_workers(gateway, 1)
    await deliver(gateway, redis, pairs, 10)
    idle = [ws for _, ws in await viewers_on_both_workers(gateway, 1, since=10)]
    await scrape_until(gateway, lambda m: m.total(CLIENTS) == 2 and m.total(SENT) == 20,
                       "both workers' figures")
    (victim,) = gateway.worker_pids()
    os.kill(victim, signal.SIGSTOP)  # alive, listening, answering nothing
    try:
        got = await scrape(gateway)
        assert got.worker == "0"
        assert got.total(WORKERS) == 2 and got.total(SCRAPED) == 1
        # Its counters stay at what it last said (a drop would read as a counter reset);
        # its gauges, which may have changed since, are left out.
        assert got.total(SENT) == 20 and got.total(CLIENTS) == 1
    finally:
        os.kill(victim, signal.SIGKILL)
    # Started again as a new process: the old one's counters stay in the sum.
    deadline = time.monotonic() + 30
    while not gateway.worker_pids() - {victim}:
        assert time.monotonic() < deadline, "the killed worker was not started again"
        await asyncio.sleep(0.2)
    await scrape_until(gateway, lambda m: m.total(SCRAPED) == 2, "the new worker 1")
    for worker, got in (await scrape_each_worker(gateway)).items():
        assert got.total(SENT) == 20 and got.total(CLIENTS) == 1, worker
    # Its new counters add to them: 5 captions to worker 0's 2 clients and worker 1's 1.
    again = [ws for _, ws in await viewers_on_both_workers(gateway, 1, since=10)]
    await scrape_until(gateway, lambda m: m.total(CLIENTS) == 3, "the new clients")
    await publish(redis, 11, 15, per_s=200)
    await scrape_until(gateway, lambda m: m.total(SENT) == 35, "the new messages")
    for ws in [*idle, *again]:
        await ws.close()


async def test_one_publisher_per_push_stream_holds_across_workers(gateway: Gateway,
                                                                  redis: Redis) -> None:
    headers = {"Authorization": f"Bearer {PUBLISH}"}
    url = f"{gateway.ws}/v1/streams/room/audio"
    async with connect(url, additional_headers=headers, open_timeout=RECV_S) as first:
        assert first.response is not None
        holder = first.response.headers[WORKER]
        await first.send(b"\0\0" * 1600)
        # The handshake completes before the gateway claims the stream: wait for the claim.
        deadline = time.monotonic() + RECV_S
        while not await redis.exists(lease_key("room")):
            assert time.monotonic() < deadline, "the first publisher holds no lease"
            await asyncio.sleep(0.05)
        refused_by: set[str] = set()
        for _ in range(30):
            async with connect(url, additional_headers=headers,
                               open_timeout=RECV_S) as second:
                assert second.response is not None
                msg = json.loads(await asyncio.wait_for(second.recv(), RECV_S))
                assert msg["code"] == "publisher_busy", msg
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await asyncio.wait_for(second.recv(), RECV_S)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 4409
                refused_by.add(second.response.headers[WORKER])
            if refused_by == {"0", "1"}:
                break
        assert refused_by == {"0", "1"}, (holder, refused_by)
    # Closed: its lease is given back (not left to expire), so another publisher is
    # taken within moments, whichever worker it lands on.
    deadline = time.monotonic() + 5
    while True:
        async with connect(url, additional_headers=headers, open_timeout=RECV_S) as again:
            try:
                msg = json.loads(await asyncio.wait_for(again.recv(),
                                                        PUBLISHER_GRACE_S + 1.0))
            except TimeoutError:
                return  # taken: a refusal comes within the grace, a publisher is told nothing
            assert msg.get("code") == "publisher_busy", msg
        assert time.monotonic() < deadline, "the lease outlived its publisher"
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("bad", [0, -1, 65, "two", "3", True, 1.5])
def test_workers_is_a_count_of_processes_or_auto(bad: object) -> None:
    with pytest.raises(ValidationError) as exc:
        GatewayConfig(workers=bad)
    assert "workers is the number of gateway processes: an integer 1-64 or 'auto'" in str(
        exc.value)
    auto = GatewayConfig(workers="auto")
    assert GatewayConfig().workers == "auto"
    assert 1 <= auto.worker_count() <= min(AUTO_GATEWAY_WORKERS_MAX, len(os.sched_getaffinity(0)))


@pytest.mark.parametrize(("files", "cores"), [
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "150000 100000\n"}, 2),
    ({"cpu.max": "50000 100000\n"}, 1),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),
    ({}, None),
])
def test_auto_follows_a_containers_cpu_limit(tmp_path: Path, files: dict[str, str],
                                             cores: int | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_limit(tmp_path) == cores


def test_babelcast_gateway_needs_the_redis_url_of_the_run_it_serves(tmp_path: Path) -> None:
    cfg = tmp_path / "event.yaml"
    cfg.write_text("""
event: no redis
streams:
  - {id: room, source: push, language: en}
""")
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "gateway", str(cfg)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "set redis.url in the event file to that run's Redis" in done.stderr
