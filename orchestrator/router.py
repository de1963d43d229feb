"""The router: pins each stream to an ASR actor within the actors' stream budget.

Placement is sticky (a stream keeps its actor while that actor lives: moving a
stream costs its session) and otherwise fills the least loaded actor first,
so rooms spread over GPUs instead of piling onto the first one. A stream whose
actor stays out of reach moves to the least loaded actor with room (`move`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class PlacementError(RuntimeError):
    pass


@dataclass
class Router:
    budget: int
    actors: list[str]
    pins: dict[str, str] = field(default_factory=dict)

    def load(self, actor: str) -> int:
        return sum(1 for a in self.pins.values() if a == actor)

    def place(self, stream_id: str) -> str:
        if stream_id in self.pins and self.pins[stream_id] in self.actors:
            return self.pins[stream_id]
        actor = self._least_loaded(avoid=set())
        if actor is None:
            raise PlacementError(
                f"stream {stream_id!r} cannot be placed: {len(self.actors)} actor(s) x "
                f"{self.budget} streams are full; raise engine.actors or "
                "engine.streams_per_actor"
            )
        self.pins[stream_id] = actor
        return actor

    def move(self, stream_id: str, avoid: set[str]) -> str | None:
        """Pin a stream to the least loaded actor outside `avoid` that has room (its
        actor is down); None when none has room (it stays where it is)."""
        actor = self._least_loaded(avoid)
        if actor is not None:
            self.pins[stream_id] = actor
        return actor

    def _least_loaded(self, avoid: set[str]) -> str | None:
        """The actor with room and the fewest streams, outside `avoid`; ties go to the
        actor listed first (stable placement)."""
        free = [a for a in self.actors if a not in avoid and self.load(a) < self.budget]
        if not free:
            return None
        return min(free, key=lambda a: (self.load(a), self.actors.index(a)))

    def release(self, stream_id: str) -> None:
        self.pins.pop(stream_id, None)

    def remove_actor(self, actor: str) -> list[str]:
        """Forget an actor; returns the streams that must be placed again."""
        self.actors = [a for a in self.actors if a != actor]
        orphans = [s for s, a in self.pins.items() if a == actor]
        for s in orphans:
            del self.pins[s]
        return orphans

    def add_actor(self, actor: str) -> None:
        if actor not in self.actors:
            self.actors.append(actor)
