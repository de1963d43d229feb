"""The router: least-loaded placement within a per-actor budget, sticky pins."""

from __future__ import annotations

import pytest

from orchestrator.router import PlacementError, Router

pytestmark = pytest.mark.unit


def loads(router: Router) -> dict[str, int]:
    return {actor: router.load(actor) for actor in router.actors}


def test_streams_spread_over_actors_least_loaded_first() -> None:
    router = Router(budget=4, actors=["gpu-0", "gpu-1", "gpu-2"])
    placed = [router.place(f"room-{i}") for i in range(5)]
    assert placed == ["gpu-0", "gpu-1", "gpu-2", "gpu-0", "gpu-1"]
    assert loads(router) == {"gpu-0": 2, "gpu-1": 2, "gpu-2": 1}


def test_new_stream_goes_to_the_least_loaded_actor_not_the_first() -> None:
    router = Router(budget=4, actors=["gpu-0", "gpu-1"])
    for stream in ("a", "b", "c"):
        router.place(stream)  # gpu-0: a, c; gpu-1: b
    router.release("b")
    assert router.place("d") == "gpu-1"
    assert router.place("e") == "gpu-1"


def test_ties_go_to_the_actor_listed_first() -> None:
    router = Router(budget=2, actors=["gpu-1", "gpu-0"])
    assert router.place("a") == "gpu-1"


def test_placement_respects_the_budget() -> None:
    router = Router(budget=2, actors=["gpu-0", "gpu-1"])
    for i in range(4):
        router.place(f"room-{i}")
    assert loads(router) == {"gpu-0": 2, "gpu-1": 2}
    with pytest.raises(PlacementError):
        router.place("room-4")
    assert "room-4" not in router.pins
    assert loads(router) == {"gpu-0": 2, "gpu-1": 2}


def test_placement_error_names_the_stream_and_the_fix() -> None:
    router = Router(budget=1, actors=["gpu-0"])
    router.place("hall-a")
    with pytest.raises(PlacementError) as info:
        router.place("hall-b")
    message = str(info.value)
    assert "'hall-b'" in message
    assert "hall-a" not in message
    assert "engine.actors" in message and "engine.streams_per_actor" in message


def test_placement_with_no_actors_raises_placement_error() -> None:
    with pytest.raises(PlacementError, match="'hall-a'"):
        Router(budget=4, actors=[]).place("hall-a")


def test_placement_is_sticky() -> None:
    router = Router(budget=3, actors=["gpu-0", "gpu-1"])
    assert router.place("a") == "gpu-0"
    router.place("b")
    router.place("c")  # gpu-0 now holds two streams, gpu-1 one
    assert router.place("a") == "gpu-0"
    assert loads(router) == {"gpu-0": 2, "gpu-1": 1}


def test_sticky_stream_is_placed_again_even_when_its_actor_is_full() -> None:
    router = Router(budget=1, actors=["gpu-0"])
    router.place("a")
    assert router.place("a") == "gpu-0"


def test_released_stream_frees_its_slot() -> None:
    router = Router(budget=1, actors=["gpu-0"])
    router.place("a")
    router.release("a")
    assert router.load("gpu-0") == 0
    assert router.place("b") == "gpu-0"


def test_releasing_an_unknown_stream_is_a_no_op() -> None:
    router = Router(budget=1, actors=["gpu-0"])
    router.place("a")
    router.release("never-placed")
    assert router.pins == {"a": "gpu-0"}


def test_removed_actor_returns_its_streams_as_orphans() -> None:
    router = Router(budget=3, actors=["gpu-0", "gpu-1"])
    for stream in ("a", "b", "c", "d"):
        router.place(stream)  # gpu-0: a, c; gpu-1: b, d
    orphans = router.remove_actor("gpu-0")
    assert sorted(orphans) == ["a", "c"]
    assert router.actors == ["gpu-1"]
    assert router.pins == {"b": "gpu-1", "d": "gpu-1"}


def test_orphans_are_placed_again_on_the_remaining_actors() -> None:
    router = Router(budget=2, actors=["gpu-0", "gpu-1", "gpu-2"])
    for stream in ("a", "b", "c"):
        router.place(stream)
    orphans = router.remove_actor("gpu-1")
    assert orphans == ["b"]
    assert router.place("b") in {"gpu-0", "gpu-2"}
    assert "gpu-1" not in router.pins.values()
    assert all(load <= 2 for load in loads(router).values())


def test_orphans_that_do_not_fit_raise_placement_error() -> None:
    router = Router(budget=1, actors=["gpu-0", "gpu-1"])
    router.place("a")
    router.place("b")
    (orphan,) = router.remove_actor("gpu-1")
    with pytest.raises(PlacementError, match=repr(orphan)):
        router.place(orphan)


def test_removing_an_unknown_actor_orphans_nothing() -> None:
    router = Router(budget=1, actors=["gpu-0"])
    router.place("a")
    assert router.remove_actor("gpu-9") == []
    assert router.pins == {"a": "gpu-0"}


def test_added_actor_takes_new_streams_first() -> None:
    router = Router(budget=2, actors=["gpu-0"])
    router.place("a")
    router.add_actor("gpu-1")
    assert router.place("b") == "gpu-1"


def test_added_actor_makes_room_after_placement_error() -> None:
    router = Router(budget=1, actors=["gpu-0"])
    router.place("a")
    with pytest.raises(PlacementError):
        router.place("b")
    router.add_actor("gpu-1")
    assert router.place("b") == "gpu-1"


def test_adding_a_known_actor_does_not_duplicate_it() -> None:
    router = Router(budget=1, actors=["gpu-0"])
    router.add_actor("gpu-0")
    assert router.actors == ["gpu-0"]


def test_replaced_actor_keeps_no_stale_pins() -> None:
    router = Router(budget=1, actors=["gpu-0"])
    router.place("a")
    orphans = router.remove_actor("gpu-0")
    router.add_actor("gpu-0")  # the same name comes back (a restarted actor)
    assert router.load("gpu-0") == 0
    assert [router.place(s) for s in orphans] == ["gpu-0"]
