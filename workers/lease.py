"""An ASR actor's lease in Redis: "I am alive and my engine works", renewed well under a
second and expiring in `ttl_s` (issue 35).

Why not Ray alone: Ray notices a lost node after ~18 s (its raylet's heartbeats), a frozen
one (SIGSTOP, a wedged kernel) not at all, and a dead engine inside a live actor never.
The lease lapses within `ttl_s` in all three; the supervisor (orchestrator.runtime) moves
the streams of an actor whose lease lapsed at once. A late writer is harmless: the
stream's new owner claims its captions (bus.claim_stream), and a publication from anyone
else is refused.

The lease is kept by a thread of its own with a synchronous Redis client, not by the
actor's event loop: a loop busy decoding (an overloaded CPU actor) must not look dead.
Only the process (vanished, frozen) or the engine (`healthy()` false: the lease is
deleted at once, no need to wait for it to expire) ends it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("babelcast.lease")

TTL_S = 1.5
RENEW_S = 0.375


def lease_key(actor_id: str) -> str:
    return f"asr:lease:{actor_id}"


class LeaseKeeper:
    """Renews `lease_key(actor_id)` every `every_s` (value: the actor id and the moment,
    for a reader's log) while `healthy()`; deletes it once not. `stop()` deletes it too:
    an actor that stops on purpose hands its streams over without waiting."""

    def __init__(self, redis_url: str, actor_id: str, healthy: Callable[[], bool],
                 ttl_s: float = TTL_S, every_s: float = RENEW_S) -> None:
        if not 0 < every_s < ttl_s:
            raise ValueError(f"lease renewed every {every_s} s must be renewed within its "
                             f"{ttl_s} s")
        import redis

        self._redis = redis.Redis.from_url(redis_url, socket_timeout=every_s,
                                           socket_connect_timeout=every_s)
        self.key = lease_key(actor_id)
        self.actor_id = actor_id
        self.healthy = healthy
        self.ttl_ms = int(ttl_s * 1000)
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease:{actor_id}",
                                        daemon=True)
        self.renewals = 0
        self.released = 0
        self._warned_at = 0.0

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        held = False
        while not self._stop.is_set():
            try:
                if self.healthy():
                    self._redis.set(self.key, f"{self.actor_id} {time.time():.3f}",
                                    px=self.ttl_ms)
                    self.renewals += 1
                    held = True
                elif held:  # the engine is dead: its streams move now, not in ttl_s
                    self._redis.delete(self.key)
                    self.released += 1
                    held = False
                    log.error("actor %s: engine unhealthy, lease released", self.actor_id)
            except Exception as exc:  # Redis away: the lease lapses, as it should
                now = time.monotonic()
                if now - self._warned_at > 60:
                    self._warned_at = now
                    log.warning("actor %s: lease not renewed: %s", self.actor_id,
                                type(exc).__name__)
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.every_s + 1)
        try:
            self._redis.delete(self.key)
        except Exception:
            pass
        finally:
            self._redis.close()
