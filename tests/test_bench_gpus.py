"""bench.voxtral_gpus on this machine: real local Ray with two LOGICAL GPUs (Ray's
resource count; no CUDA here), real Redis, ASR actors over the FAKE vLLM backend
(tests/engine_faults.py; vLLM cannot run here). The bench places one GPU's streams on
that GPU's actors only, then every GPU's on all actors, through the router, and reads
each stream's caption lag from the ASR hosts' health."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from bench import voxtral_gpus
from tests.engine_faults import FakeVllmAsrActor

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two_logical_gpus() -> Iterator[None]:
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False,
             log_to_driver=False)
    yield
    ray.shutdown()


def test_a_stream_is_real_time_while_its_captions_keep_up() -> None:
    assert voxtral_gpus.stream_realtime([0.5] * 9 + [4.0], 0.3, 3.0)  # one slow caption in 10
    assert not voxtral_gpus.stream_realtime([0.5] * 8 + [4.0] * 2, 0.3, 3.0)  # two are too many
    assert not voxtral_gpus.stream_realtime([2.0, 3.5, 4.5, 5.5], 0.3, 3.0)  # falls behind
    assert not voxtral_gpus.stream_realtime([0.5, 0.6], 6.0, 3.0)  # captions stopped
    assert not voxtral_gpus.stream_realtime([], None, 3.0)  # never captioned
    assert voxtral_gpus.gpu_of({"gpus": ["1"]}) == "1" and voxtral_gpus.gpu_of({}) == "?"


async def test_one_gpu_then_both_through_the_router(two_logical_gpus: None,
                                                     redis_url: str) -> None:
    placed: list[float] = []

    def make(aid: str, share: float, host: Any) -> Any:
        placed.append(share)
        cls = ray.remote(num_cpus=0, num_gpus=share, max_restarts=0)(FakeVllmAsrActor)
        return cls.options(name=aid).remote(host)

    args = argparse.Namespace(gpus=2, engines_per_gpu=2, ladder=[2], seconds=6.0,
                              max_lag=3.0, start_timeout=60.0)
    out = await voxtral_gpus.run(args, make_actor=make, redis_url=redis_url)
    assert placed == [0.5] * 4  # two engines per GPU, half a GPU each in Ray
    assert sorted(out["actors_by_gpu"]) == ["0", "1"]
    assert all(len(a) == 2 for a in out["actors_by_gpu"].values())
    one, both = out["by_level"][2]["one"], out["by_level"][2]["all"]
    gpu0 = set(out["actors_by_gpu"]["0"])
    # one GPU: its two actors, a stream each (the router's budget: 2 per GPU / 2 engines)
    assert one["streams"] == 2 and set(one["streams_per_actor"]) == gpu0
    assert sorted(one["streams_per_actor"].values()) == [1, 1]
    # every GPU: twice the streams, one on each of the four actors
    assert both["streams"] == 4 and sorted(both["streams_per_actor"].values()) == [1] * 4
    # the FAKE engine keeps up, so every stream captions in real time
    for row in (one, both):
        assert row["realtime_share"] == 1.0, row
        assert row["streams_without_captions"] == 0
    assert out["knee_streams"] == {"one": 2, "all": 4} and out["ratio"] == 2.0
