"""The gateway's HTML: the index of streams (`/`) and the overlay's generated script.

The overlay itself is static (`static/overlay.html`, `.js`, `.css`); its copy of
the line-breaking rules is generated from `workers.captions.linebreak`, so the
browser breaks lines exactly like the archives do.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from urllib.parse import urlencode

from workers.captions import linebreak
from workers.events import StreamOptions

STATIC_DIR = Path(__file__).resolve().parent / "static"


def linebreak_script() -> str:
    data = json.dumps(linebreak.rules(), ensure_ascii=False, sort_keys=True)
    return f"window.BABELCAST_LINEBREAK = {data};\n"


def overlay_url(stream: str, lang: str, lang2: str | None = None,
                token: str | None = None) -> str:
    """The overlay's path; with `token`, the viewer token OBS will send (?token=)."""
    query = {"lang": lang} | ({"lang2": lang2} if lang2 else {}) | (
        {"token": token} if token else {})
    return f"/overlay/{stream}?{urlencode(query)}"


def _stream_block(o: StreamOptions, hls: bool, token: str | None) -> str:
    langs = [o.caption_lang, *o.targets]
    overlays = [f'<a href="{escape(overlay_url(o.stream_id, lang, token=token))}">'
                f"{escape(lang)}</a>" for lang in langs]
    overlays += [
        f'<a href="{escape(overlay_url(o.stream_id, o.caption_lang, t, token))}">'
        f"{escape(o.caption_lang)} + {escape(t)}</a>" for t in o.targets]
    rows = [
        f"<h2>{escape(o.name or o.stream_id)} <small>{escape(o.stream_id)}</small></h2>",
        "<dl>",
        f"<dt>overlay</dt><dd>{' · '.join(overlays)}</dd>",
    ]
    if hls:
        q = f"?{urlencode({'token': token})}" if token else ""
        lists = [f'<a href="/hls/{escape(o.stream_id)}/{escape(lang)}.m3u8{escape(q)}">'
                 f"{escape(lang)}</a>" for lang in langs]
        rows.append(f"<dt>HLS WebVTT</dt><dd>{' · '.join(lists)}</dd>")
    ws = f"/v1/streams/{o.stream_id}/captions?lang={o.caption_lang}"
    rows += [f"<dt>WebSocket</dt><dd><code>{escape(ws)}</code></dd>", "</dl>"]
    return "\n".join(rows)


def index_html(event_name: str, streams: list[StreamOptions], hls: bool,
               token: str | None = None) -> str:
    """The streams with their overlay links; `token`: a viewer token the links carry."""
    title = escape(event_name or "Babelcast")
    blocks = "\n".join(_stream_block(o, hls, token) for o in streams) or "<p>No streams.</p>"
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<title>{title} — Babelcast</title>
<style>
  body {{ font: 16px/1.5 system-ui, sans-serif; max-width: 60rem; margin: 2rem auto;
         padding: 0 1rem; color: #222; }}
  h2 small {{ color: #777; font-weight: normal; font-size: 0.7em; }}
  dt {{ font-weight: 600; float: left; width: 8rem; }}
  dd {{ margin-left: 8rem; }}
  code {{ background: #f3f3f3; padding: 0 0.3em; }}
</style>
</head>
<body>
<h1>{title}</h1>
<p>Overlays have a transparent background: in OBS add a <em>Browser</em> source with the
overlay's URL, 1920 × 1080. Parameters such as <code>&amp;size=48</code>,
<code>&amp;bg=000000b0</code>, <code>&amp;lines=3</code> or <code>&amp;lang2=fr</code> change
the look (see <a href="/static/overlay.js">overlay.js</a>). Links here carry a viewer token
(<code>token=</code>): whoever has the URL can read these captions until it expires.</p>
{blocks}
<p><a href="/v1/streams">/v1/streams</a> · <a href="/metrics">/metrics</a></p>
</body>
</html>
"""
