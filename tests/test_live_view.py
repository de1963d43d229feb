"""The live view of `babelcast run` against a real Redis: it says what `babelcast status`
says (the room's state, how far behind its captions are), in the table and in `--plain`."""

from __future__ import annotations

import asyncio
import contextlib
import io
from pathlib import Path

import pytest

from orchestrator.config import load_event
from orchestrator.live import LiveView
from orchestrator.status import room_state
from workers.bus import RedisBus, connect_redis

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent


async def test_live_view_and_status_agree_on_the_state_and_show_the_lag(
    redis_url: str, bus: RedisBus
) -> None:
    cfg = load_event(ROOT / "examples" / "demo.yaml")
    a, b = (s.id for s in cfg.streams[:2])
    # a: captioned, then its encoder went away (the ingest says idle): status says
    # "source lost". b: captioning 23 s behind real time.
    await bus.set_status(a, asr_state="captioning", source_state="idle", asr_actor="asr-0",
                         caption_lag_s=0.4)
    await bus.set_status(b, asr_state="captioning", source_state="live", asr_actor="asr-0",
                         caption_lag_s=23.4)
    redis = connect_redis(redis_url)
    try:
        view = LiveView(cfg, redis, "http://127.0.0.1:8000", plain=True, unplaced=[])
        rows = {r[0]: r for r in await view.rows()}
        assert rows[a][2] == room_state(await bus.get_status(a)) == "source lost"
        assert rows[b][2] == "captioning" and rows[b][6] == "23.4 BEHIND"
        assert rows[a][6] == "0.4"
        stop = asyncio.Event()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            task = asyncio.create_task(view.run(stop))
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.wait_for(task, 10)
    finally:
        await redis.aclose()
    lines = out.getvalue().splitlines()
    line_a = next(x for x in lines if f" {a} " in x and "state=" in x)
    line_b = next(x for x in lines if f" {b} " in x and "state=" in x)
    assert 'state="source lost"' in line_a
    assert 'state="captioning"' in line_b and "lag_s=23.4_BEHIND" in line_b
