"""One WebSocket conversation with the gateway's ASGI app, in-process: no socket, no HTTP
handshake parsing, the same app object (routes, admission, Redis, hub) that uvicorn
serves to the real-socket tests.

For fuzzing what the app decides from a connection's scope (path, query, headers) at
thousands of examples a minute: a real connection costs ~0.1 s on the shared 2-core
machine, this a few milliseconds. The network path (uvicorn, the handshake, frame
limits) stays covered by the tests that use real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

Message = dict[str, Any]


@dataclass
class Conversation:
    """What the app said: `accepted` (None: it closed before accepting, which uvicorn
    answers with HTTP 403), the text frames it sent, its close code if it closed."""

    accepted: bool | None = None
    texts: list[str] = field(default_factory=list)
    close_code: int | None = None


class AsgiWebSocket:
    """Drive one WebSocket scope through `app`: `run()` connects and returns once the
    caller has seen enough; `leave()` disconnects and waits for the app's handler."""

    def __init__(self, app: Any, path: str, query: dict[str, str] | None = None, *,
                 headers: Iterable[tuple[str, str]] = (), client: str = "127.0.0.1") -> None:
        self.app = app
        self.scope: Message = {
            "type": "websocket", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "scheme": "ws", "http_version": "1.1", "path": path,
            "raw_path": path.encode(), "root_path": "",
            "query_string": urlencode(query or {}).encode(),
            "headers": [(b"host", b"testserver"),
                        *((k.lower().encode(), v.encode()) for k, v in headers)],
            "client": (client, 50000), "server": ("testserver", 80), "subprotocols": [],
            "state": {},
        }
        self.said = Conversation()
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _receive(self) -> Message:
        return await self._inbox.get()

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "websocket.accept":
            self.said.accepted = True
        elif kind == "websocket.send":
            self.said.texts.append(message.get("text") or "")
        elif kind == "websocket.close":
            if self.said.accepted is None:
                self.said.accepted = False
            self.said.close_code = message.get("code", 1000)
        self._changed.set()

    async def run(self, until: Any, timeout_s: float, poll_s: float = 0.002) -> Conversation:
        """Connect; return once `until(conversation)` is true, the app closed, or the
        app ended; `until` is checked after each message and every `poll_s` (it may
        watch state the app changes without a message). TimeoutError after
        `timeout_s`."""
        self._inbox.put_nowait({"type": "websocket.connect"})
        task = self._task = asyncio.create_task(self.app(self.scope, self._receive,
                                                         self._send))
        async with asyncio.timeout(timeout_s):
            while not (until(self.said) or self.said.close_code is not None or task.done()):
                self._changed.clear()
                waiter = asyncio.create_task(self._changed.wait())
                await asyncio.wait({waiter, task}, timeout=poll_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
        if task.done():
            task.result()  # an exception in the app fails the caller
        return self.said

    async def leave(self, timeout_s: float = 5.0) -> None:
        """The client goes away; the app must finish its handler by `timeout_s`."""
        assert self._task is not None
        self._inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})
        async with asyncio.timeout(timeout_s):
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._task.result()
