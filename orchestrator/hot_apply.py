"""Hot apply's changes to the running actors, a part of `EventRuntime`
(orchestrator/runtime.py): orchestrator.apply decides what changes and calls these with
the runtime's control_lock held.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orchestrator import metrics
from orchestrator.actor_options import stream_options, translation_host_options
from orchestrator.config import EventConfig, StreamConfig
from orchestrator.router import PlacementError, Router
from workers.aio import wait_for


class HotApply:
    """Streams that join, leave or change while the event runs, and the glossary: the
    methods of `EventRuntime` that orchestrator.apply calls."""

    # EventRuntime's fields (see there) that this part reads and writes
    cfg: EventConfig
    redis_url: str
    asr: dict[str, Any]
    ingest: dict[str, Any]
    translators: dict[str, Any]
    router: Router | None
    unplaced: list[str]
    _ingest_pins: dict[str, str]
    _down_since: dict[str, float]
    _behind_since: dict[str, float]
    _lag_moved_at: dict[str, float]

    if TYPE_CHECKING:  # EventRuntime's methods this part calls
        async def start_translators(self) -> None: ...
        def _export_placement(self) -> None: ...

    def free_slots(self, releasing: frozenset[str] = frozenset()) -> int:
        """Streams the ASR actors that are up can take, once `releasing` have left."""
        assert self.router is not None
        up = [a for a in self.router.actors if a not in self._down_since]
        held = {a: 0 for a in up}
        for sid, a in self.router.pins.items():
            if a in held and sid not in releasing:
                held[a] += 1
        return sum(max(0, self.router.budget - n) for n in held.values())

    async def add_stream(self, s: StreamConfig, timeout_s: float = 60.0) -> str:
        """Place a stream that joined the event on the least loaded ASR actor with room
        and start its ingest; returns the actor. Raises PlacementError when none has
        room. An actor that does not answer in time keeps the pin: the supervisor adds
        the stream there at its next pass (`self.cfg` must list it by then)."""
        assert self.router is not None
        opts = stream_options(s, self.cfg.translation)
        actor = self.router.move(s.id, avoid=set(self._down_since))
        if actor is None:
            raise PlacementError(f"stream {s.id!r} cannot be placed: every ASR actor that "
                                 "is up is full; remove a stream, or raise engine.actors or "
                                 "engine.streams_per_actor and restart the event")
        if s.id in self.unplaced:
            self.unplaced.remove(s.id)
        await wait_for(self.asr[actor].add_stream.remote(opts), timeout_s)
        if s.source_kind != "push":
            load = {a: 0 for a in self.ingest}
            for a in self._ingest_pins.values():
                load[a] = load.get(a, 0) + 1
            ing = min(self.ingest, key=lambda a: (load[a], list(self.ingest).index(a)))
            self._ingest_pins[s.id] = ing
            await wait_for(self.ingest[ing].add_stream.remote(opts), timeout_s)
        self._export_placement()
        return actor

    async def remove_stream(self, s: StreamConfig, timeout_s: float = 30.0) -> tuple[int, str]:
        """Drain a stream that left the event: its ingest stops (no more audio), its ASR
        session stops and a caption it left open is published as a final, once; its
        router budget is freed. Returns (the seq of its last caption in its own language,
        a problem or ""). Its outputs are closed by the caller once they have that seq."""
        assert self.router is not None
        problem = ""
        actor = self.router.pins.get(s.id)
        self.router.release(s.id)
        for seen in (self._behind_since, self._lag_moved_at):  # lag moves forget it
            seen.pop(s.id, None)
        if s.id in self.unplaced:
            self.unplaced.remove(s.id)
        ing = self._ingest_pins.pop(s.id, None)
        if ing is not None:
            try:  # first: the ASR side then sees no new audio while it closes
                await wait_for(self.ingest[ing].remove_stream.remote(s.id), timeout_s)
            except Exception as exc:
                problem = f"ingest {ing} did not stop it: {type(exc).__name__}"
        last_seq = 0
        lang = stream_options(s).caption_lang
        if actor is not None:
            try:
                last_seq = await wait_for(
                    self.asr[actor].drain_stream.remote(s.id, lang), timeout_s)
            except Exception as exc:
                # Unpinned anyway: an actor that answers again drops it (reconcile).
                problem = (f"ASR actor {actor} did not drain it ({type(exc).__name__}); "
                           "a caption it left open stays open")
        metrics.STREAM_UNPLACED.labels(stream=s.id).set(0)
        self._export_placement()
        return last_seq, problem

    async def update_stream(self, s: StreamConfig, timeout_s: float = 30.0) -> str:
        """A running stream's new targets (and name), taken by its ASR actor without
        touching its session; starts the translator pool if this is the event's first
        target. Returns a problem or ""."""
        assert self.router is not None
        if s.targets and not self.translators:
            await self.start_translators()
        actor = self.router.pins.get(s.id)
        if actor is None:
            return ""
        try:
            await wait_for(self.asr[actor].update_stream.remote(
                stream_options(s, self.cfg.translation)), timeout_s)
        except Exception as exc:  # the supervisor's next re-add uses self.cfg's targets
            return f"ASR actor {actor} did not take it: {type(exc).__name__}"
        return ""

    async def set_glossary(self, timeout_s: float = 30.0) -> list[str]:
        """Every translator takes the glossary of `self.cfg`; returns problems."""
        terms = translation_host_options(self.cfg, "", self.redis_url).glossary
        problems: list[str] = []
        for actor_id, handle in self.translators.items():
            try:
                await wait_for(handle.set_glossary.remote(terms), timeout_s)
            except Exception as exc:
                problems.append(f"{actor_id} did not take the glossary: {type(exc).__name__}")
        return problems
