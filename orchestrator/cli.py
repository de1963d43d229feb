"""`babelcast` — validate, run and watch an event.

    babelcast validate FILE          exit 0, or 2 with file:line: key: message lines
    babelcast run FILE [--duration S] [--plain]
    babelcast gateway FILE           only the gateway, against the redis.url a run publishes to
    babelcast tail STREAM [--lang xx] [--since N] [--url http://127.0.0.1:8000]
    babelcast status [--url http://127.0.0.1:8000] [--json] [--watch S]
    babelcast export STREAM [--lang xx] [--format vtt|srt] [-o FILE] [--url URL | --redis URL]
    babelcast token FILE|--url URL [--stream S]... [--lang xx]... [--ttl S] [--sub NAME]
    babelcast apply FILE [--url URL]  the changed file applied live to the running event

tail, status, apply, export --url and token --url send `--token`, else $BABELCAST_TOKEN, else (a
gateway on this machine run without an `auth` section) the run's own tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

if TYPE_CHECKING:
    from orchestrator.config import EventConfig

T = TypeVar("T")

# Imports stay inside the commands: `babelcast status` is polled every few seconds on the
# event's own machine, and the event file's models alone (pydantic, the outputs, Redis)
# cost ~0.8 s of CPU to import; status needs none of them (tests/test_status_cost.py).


def _run_async(coro: Coroutine[Any, Any, T]) -> T:
    import asyncio  # ~45 ms of imports, which `status` does without

    return asyncio.run(coro)


def _load_or_exit(path: str) -> EventConfig:
    from orchestrator.config import ConfigError, load_event

    try:
        return load_event(path)
    except ConfigError as exc:
        for issue in exc.errors:
            print(str(issue), file=sys.stderr)
        print(f"{path}: {len(exc.errors)} problem(s); nothing was started", file=sys.stderr)
        raise SystemExit(2) from None


def _warn_over_capacity(path: str, cfg: EventConfig) -> None:
    from orchestrator.capacity import over_capacity, translation_over_capacity

    for warning in (over_capacity(cfg), translation_over_capacity(cfg)):
        if warning:
            print(f"{path}: warning: {warning}", file=sys.stderr)


def cmd_validate(args: argparse.Namespace) -> int:
    from orchestrator.capacity import needs_measuring

    cfg = _load_or_exit(args.file)
    estimate = (" (estimated from the cores: the first run measures this host)"
                if needs_measuring(cfg) is not None else "")
    print(f"{args.file}: ok — event {cfg.event!r}, {len(cfg.streams)} stream(s), "
          f"{cfg.engine.actors} ASR actor(s) x {cfg.engine.streams_per_actor} streams"
          f"{estimate}")
    _warn_over_capacity(args.file, cfg)
    return 0


def _measured(path: str, cfg: EventConfig) -> EventConfig:
    """The event planned on this host's own figure: where the embedded default needs one
    that is not cached, measure it now (a few seconds, once per host and engine options)
    and load the file again."""
    from orchestrator.capacity import measure_before_planning, needs_measuring

    options = needs_measuring(cfg)
    if options is None:
        return cfg
    print(f"babelcast run: measuring how many {options.model} streams this host keeps in "
          "real time (once per host and engine options) ...", file=sys.stderr, flush=True)
    cal = _run_async(measure_before_planning(options))
    print(f"babelcast run: this host keeps {cal.streams} stream(s) per ASR actor "
          f"(decode busy {cal.busy_per_stream:.3f} s per audio s)", file=sys.stderr)
    return _load_or_exit(path)


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _measured(args.file, _load_or_exit(args.file))
    _warn_over_capacity(args.file, cfg)
    from orchestrator.source_config import read_stream_secrets

    _, problems = read_stream_secrets(cfg.streams, os.environ)
    if problems:  # names the variables, never their values
        for problem in problems:
            print(f"{args.file}: {problem}", file=sys.stderr)
        print(f"{args.file}: {len(problems)} problem(s); nothing was started", file=sys.stderr)
        return 2
    from orchestrator.redis_server import RedisServerError
    from orchestrator.run import run_event

    try:
        return _run_async(run_event(cfg, duration_s=args.duration, plain=args.plain))
    except RedisServerError as exc:  # e.g. a second run in the same folder: one line
        print(f"babelcast run: {exc}", file=sys.stderr)
        return 2


def cmd_gateway(args: argparse.Namespace) -> int:
    cfg = _load_or_exit(args.file)
    from orchestrator.run import run_gateway

    return _run_async(run_gateway(cfg))


# Close codes a gateway sends when it stops: uvicorn says 1012 (service restart) at
# shutdown, 1001 is "going away". A Babelcast gateway stops when its event does.
_GATEWAY_STOPPED = (1001, 1012)


async def _tail(url: str, stream: str, lang: str | None, since: int | None, finals: bool,
                as_json: bool, limit: int | None, token: str | None = None,
                give_up_s: float = 30.0) -> int:
    import asyncio
    import time

    import websockets

    from orchestrator.gateway.local_credentials import token_for

    token = token_for(url, "viewer", token)
    headers = {"Authorization": f"Bearer {token}"} if token else {}

    ws_url = url.replace("http://", "ws://").replace("https://", "wss://").rstrip("/")
    query = []
    if lang:
        query.append(f"lang={lang}")
    if since is not None:
        query.append(f"since={since}")
    target = f"{ws_url}/v1/streams/{stream}/captions" + ("?" + "&".join(query) if query else "")
    shown = 0
    backoff = 0.5
    reached = time.monotonic()  # the last time the gateway answered (or the start)
    while True:
        try:
            async with websockets.connect(target, additional_headers=headers) as ws:
                backoff = 0.5
                reached = time.monotonic()
                async for raw in ws:
                    msg: dict[str, Any] = json.loads(raw)
                    if msg.get("type") == "error":
                        print(f"error: {msg.get('code')}: {msg.get('message')}", file=sys.stderr)
                        return 1
                    since = int(msg["seq"])  # resume from here after a reconnect
                    target = target.split("?")[0] + "?" + "&".join(
                        [q for q in query if not q.startswith("since=")] + [f"since={since}"]
                    )
                    kind = msg.get("type", "caption")
                    if kind == "withdraw" or (finals and kind == "caption"
                                              and not msg.get("is_final")):
                        # an interim taken back: nothing to show (the JSON view shows it)
                        if not as_json or finals:
                            continue
                    if as_json:
                        print(json.dumps(msg, ensure_ascii=False), flush=True)
                    elif kind == "gap":  # speech skipped to catch up (shedding policy)
                        print(f"[{msg['seq']:>6}] ✂ {float(msg.get('gap_s', 0)):.1f} s not "
                              "captioned", flush=True)
                    else:
                        mark = "■" if msg["is_final"] else "…"
                        text = msg["text"]
                        if msg.get("error"):
                            text = f"(not translated: {msg['error']})"
                        print(f"[{msg['seq']:>6}] {mark} {text}", flush=True)
                    shown += 1
                    if limit is not None and shown >= limit:
                        return 0
        except websockets.InvalidStatus as exc:
            print(f"error: the gateway refused the connection "
                  f"({exc.response.status_code})", file=sys.stderr)
            return 1
        except websockets.ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
            if code in (4401, 4403):
                print(f"error: {exc.rcvd.reason or 'not allowed'} ({code}); pass "  # type: ignore[union-attr]
                      "--token or set $BABELCAST_TOKEN", file=sys.stderr)
                return 1
            if code in _GATEWAY_STOPPED:
                print(f"babelcast tail: the event has ended (the gateway at {url} shut down)",
                      file=sys.stderr)
                return 0
            reached = time.monotonic()
            print(f"connection lost ({type(exc).__name__}); retrying in {backoff:.1f}s",
                  file=sys.stderr)
        except OSError as exc:
            if time.monotonic() - reached > give_up_s:
                print(f"babelcast tail: no gateway at {url} for {give_up_s:.0f} s "
                      f"({type(exc).__name__}); the event has ended or is unreachable",
                      file=sys.stderr)
                return 1
            print(f"cannot reach the gateway ({type(exc).__name__}); retrying in "
                  f"{backoff:.1f}s", file=sys.stderr)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 5)


def cmd_tail(args: argparse.Namespace) -> int:
    with contextlib.suppress(KeyboardInterrupt):
        return _run_async(
            _tail(args.url, args.stream, args.lang, args.since, args.finals, args.json,
                  args.limit, args.token, args.give_up)
        )
    return 0


class _StatusClient:
    """One HTTP connection to the gateway, kept across `--watch` polls (a new connection
    each time is a handshake and a place on the gateway for every poll). The standard
    library's client: httpx alone costs ~0.2 s of CPU to import."""

    def __init__(self, url: str, token: str | None) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        self.url = url
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port
        self._path = parts.path.rstrip("/") + "/v1/status"
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._conn: Any = None

    def get(self) -> tuple[int, bytes]:
        """(status, body); raises OSError or http.client.HTTPException when the gateway
        cannot be reached. A kept connection the gateway closed meanwhile (its keep-alive
        ran out between polls) is opened again once."""
        import http.client

        for attempt in (1, 2):
            fresh = self._conn is None
            if fresh:
                kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
                self._conn = kind(self._host, self._port, timeout=10)
            try:
                self._conn.request("GET", self._path, headers=self._headers)
                resp = self._conn.getresponse()
                body: bytes = resp.read()
            except (OSError, http.client.HTTPException):
                self.close()
                if fresh or attempt == 2:
                    raise
                continue
            if resp.will_close:
                self.close()
            return resp.status, body
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _status_once(client: _StatusClient, as_json: bool, clear: bool) -> int:
    import http.client

    url = client.url
    try:
        status, body = client.get()
    except (OSError, http.client.HTTPException) as exc:
        print(f"babelcast status: cannot reach the gateway at {url} ({type(exc).__name__}); "
              "is `babelcast run` running there? set --url or $BABELCAST_URL", file=sys.stderr)
        return 2
    if status != 200:
        text = body[:200].decode("utf-8", "replace")
        print(f"babelcast status: {url}/v1/status answered {status}: {text}",
              file=sys.stderr)
        return 2
    try:
        data = json.loads(body)
    except ValueError:
        print(f"babelcast status: {url}/v1/status answered something that is not JSON; "
              "is --url a Babelcast gateway?", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(data, ensure_ascii=False), flush=True)
        return 0
    from orchestrator.status import render

    if clear:
        print("\x1b[2J\x1b[H", end="")  # a fresh screen for each refresh
    print(render(data, url), flush=True)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import time

    from orchestrator.gateway.local_credentials import token_for

    url = args.url.rstrip("/")
    client = _StatusClient(url, token_for(url, "admin", args.token))
    try:
        if not args.watch:
            return _status_once(client, args.json, clear=False)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                _status_once(client, args.json, clear=not args.json)
                time.sleep(args.watch)
        return 0
    finally:
        client.close()


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from orchestrator.outputs.archive import write_atomically
    from orchestrator.outputs.export import FORMATS, ExportError, export_captions
    from workers.captions.linebreak import get_profile

    out = None if args.output in (None, "-") else Path(args.output)
    fmt = args.format
    if fmt is None:
        suffix = out.suffix.lstrip(".").lower() if out else ""
        fmt = suffix if suffix in FORMATS else "vtt"
    try:
        if args.url and not args.redis:
            text, lang, finals = _export_via_gateway(args.url, args.stream, args.lang, fmt,
                                                     args.profile, args.token)
        else:
            redis = args.redis or os.environ.get("BABELCAST_REDIS_URL",
                                                 "redis://127.0.0.1:6379/0")
            text, lang, finals = _run_async(export_captions(
                redis, args.stream, args.lang, fmt, get_profile(args.profile)))
    except ExportError as exc:
        print(f"babelcast export: {exc}", file=sys.stderr)
        return 2
    if out is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return 0
    try:
        write_atomically(out, text)
    except OSError as exc:
        print(f"babelcast export: cannot write {out}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"{out}: {finals} captions of {args.stream} in {lang!r} ({fmt})", file=sys.stderr)
    return 0


def _export_via_gateway(url: str, stream: str, lang: str | None, fmt: str, profile: str,
                        token: str | None) -> tuple[str, str, int]:
    """(file text, language, finals) from the gateway's transcript endpoint."""
    import httpx

    from orchestrator.gateway.local_credentials import token_for
    from orchestrator.outputs.export import ExportError

    url = url.rstrip("/")
    token = token_for(url, "viewer", token)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    params = {"profile": profile} | ({"lang": lang} if lang else {})
    try:
        resp = httpx.get(f"{url}/v1/streams/{quote(stream, safe='')}/transcript.{fmt}",
                         params=params, headers=headers, timeout=60)
    except httpx.HTTPError as exc:
        raise ExportError(f"cannot reach the gateway at {url} ({type(exc).__name__}); is "
                          "`babelcast run` running there? set --url or $BABELCAST_URL"
                          ) from None
    if resp.status_code != 200:
        try:
            detail = str(resp.json().get("detail", ""))
        except ValueError:
            detail = resp.text[:200]
        hint = ("; pass --token (a viewer token for this stream and language, or the admin "
                "token) or set $BABELCAST_TOKEN" if resp.status_code in (401, 403) else "")
        raise ExportError(f"{url} answered {resp.status_code}: {detail}{hint}")
    return (resp.text, resp.headers.get("content-language", lang or "?"),
            int(resp.headers.get("x-babelcast-finals", "0")))


def _apply_url(cfg: EventConfig, explicit: str | None) -> str:
    """--url, else $BABELCAST_URL, else the gateway the file itself names."""
    if explicit:
        return explicit.rstrip("/")
    if os.environ.get("BABELCAST_URL"):
        return os.environ["BABELCAST_URL"].rstrip("/")
    host = cfg.gateway.host
    if host in ("0.0.0.0", "::", ""):  # listens everywhere: this machine reaches it here
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{cfg.gateway.port or 8000}"


def _print_apply(reply: dict[str, Any]) -> None:
    status = reply.get("status", "?")
    for line in reply.get("refused") or ():
        print(f"refused: {line}", file=sys.stderr)
    if status == "refused":
        print("nothing was applied", file=sys.stderr)
        return
    placed, drained = reply.get("placed") or {}, reply.get("drained") or {}
    print(f"event {reply.get('event', '?')!r}: {status}")
    for sid in reply.get("added") or ():
        print(f"  added      {sid}" + (f" (on {placed[sid]})" if sid in placed else ""))
    for sid in reply.get("removed") or ():
        d = drained.get(sid, {})
        extra = ", ".join(f"{k} {v}" for k, v in d.items())
        print(f"  removed    {sid}" + (f" ({extra})" if extra else ""))
    for sid, fields in (reply.get("changed") or {}).items():
        print(f"  changed    {sid}: {', '.join(fields)}")
    if reply.get("unchanged"):
        print(f"  unchanged  {', '.join(reply['unchanged'])}")
    if reply.get("glossary"):
        print("  glossary   applied")
    if reply.get("youtube"):
        print("  youtube    sinks updated")
    for line in reply.get("problems") or ():
        print(f"problem: {line}", file=sys.stderr)


def cmd_apply(args: argparse.Namespace) -> int:
    """Validate here (what `validate` prints, nothing sent when invalid), then hand the
    file to the running event's gateway (POST /v1/admin/apply) and print its answer."""
    from pathlib import Path

    import httpx

    from orchestrator.gateway.local_credentials import token_for

    cfg = _load_or_exit(args.file)
    path = Path(args.file)
    url = _apply_url(cfg, args.url)
    token = token_for(url, "admin", args.token)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = {"yaml": path.read_text(encoding="utf-8"), "filename": args.file,
            "base_dir": str(path.parent.resolve())}
    try:
        resp = httpx.post(f"{url}/v1/admin/apply", json=body, headers=headers, timeout=180)
    except httpx.HTTPError as exc:
        print(f"babelcast apply: cannot reach the gateway at {url} ({type(exc).__name__}); "
              "is `babelcast run` running there? set --url or $BABELCAST_URL; nothing was "
              "applied", file=sys.stderr)
        return 2
    try:
        reply: dict[str, Any] = resp.json()
    except ValueError:
        reply = {}
    if resp.status_code == 422 and reply.get("errors"):
        for line in reply["errors"]:
            print(line, file=sys.stderr)
        print(f"{args.file}: {len(reply['errors'])} problem(s); nothing was applied",
              file=sys.stderr)
        return 2
    if "status" not in reply:
        hint = ("; pass --token (the admin token) or set $BABELCAST_TOKEN"
                if resp.status_code in (401, 403) else "")
        print(f"babelcast apply: {url}/v1/admin/apply answered {resp.status_code}: "
              f"{reply.get('detail', resp.text[:300])}{hint}", file=sys.stderr)
        return 2
    _print_apply(reply)
    if reply["status"] in ("applied", "unchanged"):
        return 0 if reply.get("ok", True) else 1
    return 2


def cmd_token(args: argparse.Namespace) -> int:
    """A viewer token: signed here with the key the event file names, or minted by a
    running gateway (`--url`, with the admin token)."""
    from orchestrator.gateway.auth import SecretsError, mint_viewer_token

    ttl = args.ttl
    if args.url:
        import httpx

        from orchestrator.gateway.local_credentials import token_for

        admin = token_for(args.url, "admin", args.token)
        if not admin:
            print("babelcast token: --url needs the admin token (--token or "
                  "$BABELCAST_TOKEN)", file=sys.stderr)
            return 2
        body: dict[str, Any] = {"streams": args.stream or None, "langs": args.lang or None,
                                "sub": args.sub, "ttl_s": int(ttl) if ttl else None}
        try:
            resp = httpx.post(f"{args.url.rstrip('/')}/v1/tokens", json=body, timeout=10,
                              headers={"Authorization": f"Bearer {admin}"})
        except httpx.HTTPError as exc:
            print(f"babelcast token: cannot reach {args.url} ({type(exc).__name__})",
                  file=sys.stderr)
            return 2
        if resp.status_code != 200:
            print(f"babelcast token: {resp.status_code}: {resp.text[:300]}", file=sys.stderr)
            return 2
        print(resp.json()["token"])
        return 0
    if not args.file:
        print("babelcast token: give the event FILE (signs here) or --url", file=sys.stderr)
        return 2
    cfg = _load_or_exit(args.file)
    auth = cfg.auth
    if auth is None or auth.signing_key_env is None:
        print("babelcast token: the event file has no auth.signing_key_env; for a run "
              "without an auth section use --url (on this machine)", file=sys.stderr)
        return 2
    key = os.environ.get(auth.signing_key_env, "").strip().encode()
    known = {s.id for s in cfg.streams}
    unknown = sorted(set(args.stream or ()) - known)
    if unknown:
        print(f"babelcast token: no stream(s) {', '.join(unknown)} in {args.file}",
              file=sys.stderr)
        return 2
    try:
        print(mint_viewer_token(key or None, streams=args.stream or None,
                                langs=args.lang or None, ttl_s=ttl or auth.viewer_ttl_s,
                                subject=args.sub))
    except (SecretsError, ValueError) as exc:
        print(f"babelcast token: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="babelcast", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check an event file")
    v.add_argument("file")
    v.set_defaults(func=cmd_validate)
    r = sub.add_parser("run", help="run an event until Ctrl-C or --duration")
    r.add_argument("file")
    r.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    r.add_argument("--plain", action="store_true",
                   help="print status lines instead of the live terminal view")
    r.set_defaults(func=cmd_run)
    g = sub.add_parser("gateway", help="serve only the gateway (gateway.workers processes) "
                                       "against the event's redis.url, e.g. behind a load "
                                       "balancer on other machines")
    g.add_argument("file")
    g.set_defaults(func=cmd_gateway)
    t = sub.add_parser("tail", help="print a stream's captions as a client")
    t.add_argument("stream")
    t.add_argument("--lang", default=None)
    t.add_argument("--since", type=int, default=None)
    t.add_argument("--url", default=os.environ.get("BABELCAST_URL", "http://127.0.0.1:8000"))
    t.add_argument("--finals", action="store_true", help="only finished captions")
    t.add_argument("--json", action="store_true", help="one JSON message per line")
    t.add_argument("--limit", type=int, default=None, help="exit after N captions")
    t.add_argument("--token", default=None, help="a viewer (or admin) token")
    t.add_argument("--give-up", type=float, default=30.0, metavar="S",
                   help="exit when no gateway answers for S seconds (default 30)")
    t.set_defaults(func=cmd_tail)
    st = sub.add_parser("status", help="print a running event's headline figures")
    st.add_argument("--url", default=os.environ.get("BABELCAST_URL", "http://127.0.0.1:8000"),
                    help="the event's gateway (default: $BABELCAST_URL or local 8000)")
    st.add_argument("--json", action="store_true", help="the gateway's /v1/status JSON")
    st.add_argument("--watch", type=float, default=None, metavar="S",
                    help="refresh every S seconds until Ctrl-C")
    st.add_argument("--token", default=None, help="the admin token")
    st.set_defaults(func=cmd_status)
    e = sub.add_parser("export", help="write a stream's finals as WebVTT or SRT (from the "
                       "gateway, or straight from Redis)")
    e.add_argument("stream")
    e.add_argument("--lang", default=None,
                   help="caption language (default: --url: the stream's own; --redis: the "
                        "only one it has)")
    e.add_argument("--format", choices=("vtt", "srt"), default=None,
                   help="default: from the -o file's extension, else vtt")
    e.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    e.add_argument("--profile", choices=("web", "cea608", "youtube"), default="web",
                   help="line-breaking profile of the cues")
    where = e.add_mutually_exclusive_group()
    where.add_argument("--url", default=os.environ.get("BABELCAST_URL"),
                       help="the event's gateway (default: $BABELCAST_URL); needs a viewer "
                            "token of the stream or the admin token (--token)")
    where.add_argument("--redis", default=None,
                       help="read the event's Redis instead (default when no --url: "
                            "$BABELCAST_REDIS_URL or local 6379)")
    e.add_argument("--token", default=None, help="with --url: a viewer or the admin token")
    e.set_defaults(func=cmd_export)
    ap = sub.add_parser("apply", help="apply a changed event file to the running event: "
                        "streams added, removed, targets and glossary changed live")
    ap.add_argument("file")
    ap.add_argument("--url", default=None, help="the event's gateway (default: "
                    "$BABELCAST_URL, else the gateway the file names)")
    ap.add_argument("--token", default=None, help="the admin token")
    ap.set_defaults(func=cmd_apply)
    k = sub.add_parser("token", help="mint a viewer token (for OBS overlay URLs, HLS, tail)")
    k.add_argument("file", nargs="?", default=None,
                   help="the event file: sign here with its auth.signing_key_env")
    k.add_argument("--url", default=None,
                   help="instead: ask this running gateway (needs the admin token)")
    k.add_argument("--token", default=None, help="with --url: the admin token")
    k.add_argument("--stream", action="append", help="a stream it may read (repeat; "
                   "default: all)")
    k.add_argument("--lang", action="append", help="a language it may read (repeat; "
                   "default: all)")
    k.add_argument("--ttl", type=float, default=None, metavar="S",
                   help="lifetime in seconds (default: auth.viewer_ttl_s)")
    k.add_argument("--sub", default="viewer", help="who it is for (the JWT's sub)")
    k.set_defaults(func=cmd_token)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
