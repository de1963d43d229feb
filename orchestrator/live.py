"""The live terminal view of `babelcast run`: each stream's state and last caption."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

from redis.asyncio import Redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from orchestrator.config import EventConfig
from orchestrator.status import BEHIND_S, room_state
from workers.aio import wait_for
from workers.bus import RedisBus


class LiveView:
    def __init__(self, cfg: EventConfig, redis: Redis, base_url: str, *, plain: bool,
                 unplaced: list[str], viewer_token: str | None = None) -> None:
        self.cfg = cfg
        self.bus = RedisBus(redis)
        self.base = base_url
        self.plain = plain or not sys.stdout.isatty()
        self.unplaced = unplaced
        self.viewer_token = viewer_token
        self.console = Console()

    def urls(self) -> list[str]:
        """The overlay URLs, each with the viewer token OBS needs (see README, Security)."""
        tok = f"token={self.viewer_token}" if self.viewer_token else ""
        amp = f"&{tok}" if tok else ""
        lines = [f"overlays  {self.base}/{'?' + tok if tok else ''}   (add one to OBS as a "
                 "Browser source)",
                 f"gateway   {self.base}/v1/streams", f"metrics   {self.base}/metrics"]
        for s in self.cfg.streams:
            lang = s.language if s.language != "auto" else "src"
            lines.append(f"{s.id:<9} {self.base}/overlay/{s.id}?lang={lang}{amp}")
            for target in s.targets:
                lines.append(f"{'':<9} {self.base}/overlay/{s.id}?lang={target}{amp}"
                             f"   (babelcast tail {s.id} --lang {target} --url {self.base})")
        return lines

    async def rows(self) -> list[tuple[str, str, str, str, str, str, str, str]]:
        """(stream, source, state, actor, finals, final latency, lag, last caption): the
        state is the room's as `babelcast status` says it (status.room_state)."""
        out = []
        for s in self.cfg.streams:
            lang = s.language if s.language != "auto" else "src"
            try:
                st = await self.bus.get_status(s.id)
                last = await self.bus.last_caption(s.id, lang)
            except Exception as exc:
                st, last = {"source_state": f"redis: {type(exc).__name__}"}, None
            state = room_state(st)
            if s.id in self.unplaced:
                state = "UNPLACED"
            lag = st.get("caption_lag_s", "-")
            try:
                if float(lag) > BEHIND_S and state == "captioning":
                    lag += " BEHIND"
            except ValueError:
                pass
            out.append((
                s.id,
                st.get("source_state", "-") + (" ⚠" if st.get("source_error") else ""),
                state,
                st.get("asr_actor", "-"),
                str(int(float(st.get("finals", 0)))),
                st.get("last_final_latency_s", "-"),
                lag,
                (last.text if last else "")[-70:],
            ))
        return out

    def table(self, rows: list[tuple[str, str, str, str, str, str, str, str]]) -> Table:
        t = Table(title=f"Babelcast — {self.cfg.event}", expand=True)
        for col in ("stream", "source", "state", "actor", "finals", "final lat s", "lag s",
                    "last caption"):
            t.add_column(col, overflow="ellipsis", no_wrap=True)
        for r in rows:
            t.add_row(*r)
        return t

    def redis_line(self) -> str:
        """Where the captions live, for `babelcast export` (never the password)."""
        kw = self.bus.redis.connection_pool.connection_kwargs
        where = (f"unix://{kw['path']}" if "path" in kw else
                 f"redis://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}")
        stream = self.cfg.streams[0].id if self.cfg.streams else "STREAM"
        return f"redis     {where}   (babelcast export {stream} --redis {where})"

    async def run(self, stop: asyncio.Event) -> None:
        header = "\n".join([*self.urls(), self.redis_line()])
        if self.plain:
            print(header, flush=True)
            while not stop.is_set():
                for r in await self.rows():
                    print(f"{time.strftime('%H:%M:%S')} {r[0]} state=\"{r[2]}\" "
                          f"source={r[1]} actor={r[3]} finals={r[4]} "
                          f"final_latency_s={r[5]} lag_s={r[6].replace(' ', '_')}",
                          flush=True)
                with contextlib.suppress(TimeoutError):
                    await wait_for(stop.wait(), 5)
            return
        with Live(console=self.console, refresh_per_second=2, transient=False) as live:
            while not stop.is_set():
                live.update(Group(self.table(await self.rows()), Text(header, style="dim")))
                with contextlib.suppress(TimeoutError):
                    await wait_for(stop.wait(), 1)
