"""What the runtime tells an ASR host: its actor id, Redis, stream budget and policies."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.sessions.manager import SessionPolicy


@dataclass(frozen=True, slots=True)
class AsrHostOptions:
    actor_id: str
    redis_url: str
    max_streams: int
    restart_backoff_s: float = 1.0
    read_block_ms: int = 200
    read_every_ms: int = 20
    """The shortest time between two audio reads. Encoders send each stream's chunks at
    their own instants, so a read loop that reads again as soon as a read returns makes one
    XREAD per chunk: a round trip (the command, its reply, the loop's wake-ups) for every
    80 ms chunk of every stream, ~45 % of an actor's own CPU at 25 and at 50 streams
    (bench.actor_cpu). Waiting this long gathers many streams' chunks into one read; a
    chunk waits at most this long (the vllm engine hands audio to the model on an 80 ms
    tick, the embedded one decodes each second). 0: read again at once."""
    session_policy: SessionPolicy = field(default_factory=SessionPolicy)
    max_backlog_s: float = 20.0
    """Audio seconds one stream may get ahead of real time in this actor (a publisher's
    catch-up burst fits); beyond it its audio is skipped (see workers.backlog)."""
    max_catchup_s: float = 15.0
    """A stream that comes to this actor from another (a restart, a failover) resumes
    where its last final ended, at most this far behind the live edge, and catches up
    faster than real time; audio older than that is skipped and counted. Below
    `max_backlog_s`, so the catch-up burst is admitted."""
    vad_process: bool = False
    """Voice activity in a helper process (GPU actors: keeps Silero, which holds the
    GIL, off the event loop that also runs vLLM's front end)."""
    vad_processes: int = 1
    """Helper processes for that (`VadService`); each holds ~`vad.STREAMS_PER_PROCESS`
    streams."""
    lease_ttl_s: float | None = None
    """Keep this actor's lease in Redis (workers/lease.py) with this expiry while its
    engine works, so the supervisor moves its streams within seconds of a lost node, a
    frozen process or a dead engine; None: no lease (a host outside an event)."""

