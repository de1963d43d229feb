"""The headline figures of a running event, for operators without Grafana.

`collect` reads them from Redis (the `status:{stream}` and `actor:{id}` hashes the
actors keep, the event's actors as the runtime registered them in `babelcast:actors`,
and each language's newest caption) for the gateway's `/v1/status`;
`render` turns that JSON into the text `babelcast status` prints. Caption text
is never part of either. The gateway adds `clients.gateway_workers` (`count`, and how
many were `counted`: with several gateway workers the client counts are their sum).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from workers.events import StreamOptions

if TYPE_CHECKING:  # the Redis client costs ~0.3 s to import: `babelcast status` reads no Redis
    from workers.bus import RedisBus

ACTORS_KEY = "babelcast:actors"
"""Set of the running event's actor ids (written by the runtime when it starts them)."""

STALE_S = 15.0
"""An actor whose hash was not updated for this long is reported as silent (actors
report every second)."""

BEHIND_S = 10.0
"""A room whose captions are more than this behind real time is shown as behind, with
what to do (`workers.asr.LAG_BEHIND_S`, the CaptionsBehind alert's bound)."""

BEHIND_ADVICE = ("fewer streams per ASR actor (engine.streams_per_actor), more actors, "
                 "or a smaller model")

LOST_SOURCE_STATES = frozenset({"idle", "reconnecting"})
"""Ingest states in which no audio comes although the stream runs: the room says `source
lost` (or `waiting for source` before its first caption), as it does while the ASR side
feeds only filler (`source_silent_s` > 0)."""


def room_state(st: Mapping[str, str]) -> str:
    """What a room is doing, from its status hash: the source's side first, because a
    session fed only filler still looks like `captioning` to the ASR side."""
    if st.get("placement", "") == "unplaced":
        return "unplaced"
    asr = st.get("asr_state", "waiting")
    source = st.get("source_state", "")
    if source == "ended":
        return "ended"
    if source == "failed":
        return "source failed"
    silent = (_num(st, "source_silent_s") or 0.0) > 0
    if silent or source in LOST_SOURCE_STATES:
        return "source lost" if asr == "captioning" else "waiting for source"
    return asr


def typed_status(st: Mapping[str, str]) -> dict[str, Any]:
    """A stream's status hash for JSON: numbers as numbers (Redis keeps strings: a count
    read "2.0"; counts become integers), the room's `state` as `status` says it, and
    `asr_state` that does not say `captioning` once the source has ended."""
    out: dict[str, Any] = {}
    for key, raw in st.items():
        try:
            value = float(raw)
        except ValueError:
            out[key] = raw
            continue
        if value != value or value in (float("inf"), float("-inf")):
            out[key] = raw  # not a JSON number
        elif value.is_integer() and not key.endswith(("_s", "_at")):
            out[key] = int(value)  # a count (seconds and times stay floats)
        else:
            out[key] = value
    out["state"] = room_state(st)
    if out["state"] == "ended" and st.get("asr_state") == "captioning":
        out["asr_state"] = "ended"
    return out


def _num(fields: Mapping[str, str], key: str) -> float | None:
    try:
        return float(fields[key])
    except (KeyError, ValueError):
        return None


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _actor_key(actor_id: str) -> str:
    from workers.bus import actor_key

    return actor_key(actor_id)


async def register_actors(bus: RedisBus, actor_ids: list[str]) -> None:
    """The event's actors, replacing an earlier event's (whose hashes may linger)."""
    async with bus.redis.pipeline(transaction=True) as pipe:
        pipe.delete(ACTORS_KEY)
        if actor_ids:
            pipe.sadd(ACTORS_KEY, *actor_ids)
        await pipe.execute()


async def _actors(bus: RedisBus) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for member in sorted(_str(m) for m in await bus.redis.smembers(ACTORS_KEY)):
        raw = await bus.redis.hgetall(_actor_key(member))
        out[member] = {_str(k): _str(v) for k, v in raw.items()}
    return out


async def _stream(bus: RedisBus, o: StreamOptions, clients: Mapping[tuple[str, str], int],
                  now: float) -> dict[str, Any]:
    st = await bus.get_status(o.stream_id)
    placement = st.get("placement", "")
    state = room_state(st)
    last_at = _num(st, "last_caption_at")
    translations: dict[str, Any] = {}
    for lang in o.targets:
        seg = await bus.last_caption(o.stream_id, lang)
        translations[lang] = {
            "last_age_s": _round(now - seg.emit_time, 1) if seg else None,
            "speech_to_translation_s": _round(seg.emit_time - seg.audio_end_wall)
            if seg and seg.is_final else None,
            "error": bool(seg and seg.error),
        }
    return {
        "id": o.stream_id,
        "name": o.name,
        "language": o.caption_lang,
        "state": state,
        "source_state": st.get("source_state", "-"),
        "source_error": st.get("source_error", ""),
        "actor": st.get("asr_actor") or (placement if placement != "unplaced" else "") or None,
        "last_caption_age_s": _round(now - last_at, 1) if last_at else None,
        "last_final_latency_s": _round(_num(st, "last_final_latency_s")),
        "finals": int(_num(st, "finals") or 0),
        "speech_without_caption_s": _round(_num(st, "speech_without_caption_s"), 1),
        # How far behind real time its captions are (None before its ASR reports).
        "caption_lag_s": _round(_num(st, "caption_lag_s"), 1),
        "behind": (_num(st, "caption_lag_s") or 0.0) > BEHIND_S and state == "captioning",
        "rollovers": int(sum(float(v) for k, v in st.items() if k.startswith("rollovers_"))),
        "gaps": int(_num(st, "gaps") or 0),
        # Source stalls the ASR side filled, the filler fed, and real audio that came
        # after its time was filled (thrown away: counted so it is seen).
        "stalls": int(_num(st, "stalls") or 0),
        "filler_s": _round(_num(st, "gap_fill_s") or 0.0, 1),
        "dropped_audio_s": _round(_num(st, "late_audio_dropped_s") or 0.0, 1),
        "source_silent_s": _round(_num(st, "source_silent_s") or 0.0, 1),
        "stall_threshold_s": _round(_num(st, "stall_threshold_s")),
        "source_note": st.get("source_note", ""),
        "source_refused": int(_num(st, "source_refused") or 0),
        "source_reconnects": int(_num(st, "source_reconnects") or 0),
        "clients": sum(n for (s, _), n in clients.items() if s == o.stream_id),
        "translations": translations,
    }


def _actor(actor_id: str, h: Mapping[str, str], now: float) -> dict[str, Any]:
    updated = _num(h, "updated")
    age = None if updated is None else now - updated
    out: dict[str, Any] = {
        "id": actor_id,
        "role": h.get("kind", "asr" if "max_streams" in h else "unknown"),
        "reported_age_s": _round(age, 1),
        "silent": age is None or age > STALE_S,
    }
    if out["role"] == "ingest":
        out.update(streams=int(_num(h, "streams") or 0),
                   live=int(_num(h, "streams_live") or 0),
                   idle=int(_num(h, "streams_idle") or 0),
                   reconnecting=int(_num(h, "streams_reconnecting") or 0)
                   + int(_num(h, "streams_connecting") or 0))
    elif out["role"] == "asr":
        busy, audio = _num(h, "decode_busy_s"), _num(h, "audio_s")
        ok = _num(h, "engine_ok")
        out.update(streams=int(_num(h, "streams") or 0),
                   max_streams=int(_num(h, "max_streams") or 0),
                   rtf=_round(busy / audio, 3) if busy is not None and audio else None,
                   engine_ok=None if ok is None else bool(ok),
                   engine_mode=h.get("engine_mode"),
                   # why a vllm engine rolls over although re-anchoring was asked for
                   engine_mode_why=h.get("engine_mode_why") or None,
                   reanchors=int(_num(h, "reanchors") or 0) if "reanchors" in h else None,
                   # Its streams' view of its health: a fast engine can still leave them
                   # behind (more streams than it carries).
                   max_caption_lag_s=_round(_num(h, "max_caption_lag_s"), 1),
                   streams_behind=int(_num(h, "streams_behind") or 0),
                   # what the embedded engine measured this host to carry (engines/calibrate)
                   calibrated_streams=int(_num(h, "calibrated_streams") or 0) or None)
    elif out["role"] == "translator":
        out.update(finals_published=int(_num(h, "finals_published") or 0),
                   errors=int(_num(h, "errors") or 0),
                   lag_p50_s=_num(h, "lag_p50_s"), lag_p95_s=_num(h, "lag_p95_s"),
                   queue_waiting=int(_num(h, "queue_lag") or 0),
                   queue_pending=int(_num(h, "queue_pending") or 0),
                   queue_oldest_age_s=_num(h, "queue_oldest_age_s"))
    return out


def _translation(actors: Mapping[str, Mapping[str, str]], live: set[str]) -> dict[str, Any]:
    """Per-language lag (the worst translator's) and the job queue (one queue: every
    translator reports the same figures)."""
    langs: dict[str, dict[str, float]] = {}
    queue = {"waiting": 0, "pending": 0, "oldest_age_s": 0.0}
    for actor_id, h in actors.items():
        if h.get("kind") != "translator" or actor_id not in live:
            continue
        for key, raw in h.items():
            for q in ("p50", "p95"):
                prefix = f"lag_{q}_s_"
                if key.startswith(prefix):
                    lang = key.removeprefix(prefix)
                    entry = langs.setdefault(lang, {})
                    entry[f"lag_{q}_s"] = max(entry.get(f"lag_{q}_s", 0.0), float(raw))
        queue["waiting"] = max(queue["waiting"], int(_num(h, "queue_lag") or 0))
        queue["pending"] = max(queue["pending"], int(_num(h, "queue_pending") or 0))
        queue["oldest_age_s"] = max(queue["oldest_age_s"], _num(h, "queue_oldest_age_s") or 0.0)
    return {"languages": dict(sorted(langs.items())), "queue": queue}


async def collect(bus: RedisBus, streams: list[StreamOptions], event: str,
                  clients: Mapping[tuple[str, str], int],
                  now: float | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    actors_raw = await _actors(bus)
    actors = [_actor(a, h, now) for a, h in sorted(actors_raw.items())]
    live = {a["id"] for a in actors if not a["silent"]}
    by_stream: dict[str, dict[str, int]] = {}
    for (stream, lang), n in sorted(clients.items()):
        if n:
            by_stream.setdefault(stream, {})[lang] = n
    return {
        "event": event,
        "time": now,
        "streams": [await _stream(bus, o, clients, now) for o in streams],
        "actors": actors,
        "translation": _translation(actors_raw, live),
        "clients": {"total": sum(clients.values()), "by_stream": by_stream},
    }


# ---- text --------------------------------------------------------------------------


def _s(value: float | None, unit: str = " s", digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in [header, *rows]]


def render(status: Mapping[str, Any], url: str = "") -> str:
    lines = [f"Babelcast — {status.get('event', '')}" + (f"  ({url})" if url else ""), ""]
    rows: list[tuple[str, ...]] = []
    for s in status["streams"]:
        state = s["state"] + (" ⚠" if s.get("source_error") else "")
        rows.append((s["id"], state, s["source_state"], s["actor"] or "-",
                     _s(s["last_caption_age_s"], " s ago"), _s(s["last_final_latency_s"],
                                                               digits=2),
                     str(s["finals"]), _s(s["speech_without_caption_s"]),
                     _s(s.get("caption_lag_s")) + (" BEHIND" if s.get("behind") else ""),
                     str(s.get("stalls", 0)), _s(s.get("filler_s")),
                     _s(s.get("dropped_audio_s")), str(s["rollovers"]), str(s["clients"])))
    lines += _table(("ROOM", "STATE", "SOURCE", "ACTOR", "LAST CAPTION", "FINAL LATENCY",
                     "FINALS", "SPEECH W/O CAPTION", "LAG", "STALLS", "FILLER", "DROPPED",
                     "ROLLOVERS", "CLIENTS"), rows)
    behind = [s for s in status["streams"] if s.get("behind")]
    if behind:
        lines += ["", "Behind real time: " + ", ".join(
            f"{s['id']} {s['caption_lag_s']:.0f} s (on {s['actor'] or '-'})" for s in behind)
            + f". Captions come late but no speech is dropped; {BEHIND_ADVICE}."]
    tr = status["translation"]
    per_room = [(s["id"], lang, t) for s in status["streams"]
                for lang, t in s["translations"].items()]
    if per_room or tr["languages"]:
        q = tr["queue"]
        lines += ["", f"Translation queue: {q['waiting']} waiting, {q['pending']} in progress, "
                      f"oldest {_s(q['oldest_age_s'])}"]
        rows = []
        for stream, lang, t in per_room:
            lag = tr["languages"].get(lang, {})
            rows.append((stream, lang, _s(lag.get("lag_p50_s"), digits=2),
                         _s(lag.get("lag_p95_s"), digits=2),
                         _s(t["speech_to_translation_s"], digits=2),
                         _s(t["last_age_s"], " s ago"), "ERROR" if t["error"] else ""))
        lines += _table(("ROOM", "LANG", "LAG P50", "LAG P95", "SPEECH→TRANSLATION",
                         "LAST", ""), rows)
    rows = []
    for a in status["actors"]:
        if a["role"] == "ingest":
            load = f"{a['streams']} streams: {a['live']} live, {a['idle']} idle"
            extra = f"{a['reconnecting']} reconnecting" if a.get("reconnecting") else ""
        elif a["role"] == "asr":
            load = f"{a['streams']}/{a['max_streams']} streams"
            parts = [f"rtf {a['rtf']:.2f}" if a.get("rtf") is not None else "",
                     f"host carries {a['calibrated_streams']}"
                     if a.get("calibrated_streams") else "",
                     f"{a['streams_behind']} behind (max lag {a['max_caption_lag_s']:.0f} s)"
                     if a.get("streams_behind") else "",
                     "ENGINE DEAD" if a.get("engine_ok") is False else "",
                     a.get("engine_mode") or ""]
            if a.get("engine_mode_why"):
                parts[-1] += f" (re-anchoring off: {a['engine_mode_why']})"
            if a.get("reanchors"):
                parts.append(f"{a['reanchors']} re-anchors")
            extra = ", ".join(p for p in parts if p)
        elif a["role"] == "translator":
            load = f"{a['finals_published']} finals"
            extra = f"errors {a['errors']}" if a.get("errors") else ""
        else:
            load, extra = "", ""
        seen = "SILENT " if a["silent"] else ""
        rows.append((a["id"], a["role"], load, extra,
                     seen + _s(a["reported_age_s"], " s ago")))
    if rows:
        lines += ["", *_table(("ACTOR", "ROLE", "LOAD", "", "LAST REPORT"), rows)]
    c = status["clients"]
    lines += ["", f"Clients: {c['total']} connected" + "".join(
        f"; {stream}: " + ", ".join(f"{lang} {n}" for lang, n in langs.items())
        for stream, langs in c["by_stream"].items())]
    workers = c.get("gateway_workers") or {}
    if workers.get("count", 1) > 1:
        lines.append(f"Gateway workers: {workers['count']}, {workers['counted']} counted"
                     + ("" if workers["counted"] == workers["count"] else
                        " (the others did not answer in time)"))
    return "\n".join(lines)
