"""The caption overlay in headless Chromium (Debian's, through Playwright) against the real
gateway and Redis: captions appear and grow, a reload resumes without repeats or gaps,
URL parameters change the rendering, nothing stale survives a long disconnect."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser, Page, async_playwright
from playwright.async_api import TimeoutError as PlaywrightTimeout

from orchestrator.gateway.access import GatewaySecurity
from orchestrator.gateway.auth import Authenticator, GatewaySecrets, mint_viewer_token
from orchestrator.redis_server import free_port
from tests.outputs_support import (
    ADMIN_TOKEN,
    Gateway,
    caption,
    hall,
    running_gateway,
    start_gateway,
)
from tests.speech import ROOT
from workers.bus import RedisBus
from workers.captions.linebreak import wrap
from workers.events import CaptionSegment

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
WAIT_MS = 10_000
ARTIFACTS = ROOT / "artifacts"


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                          args=CHROMIUM_ARGS)
        yield browser
        await browser.close()


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[Gateway]:
    async with running_gateway(redis_url, [hall(("fr",))]) as gw:
        yield gw


async def new_page(browser: Browser) -> Page:
    page = await browser.new_page(viewport={"width": 1280, "height": 720})
    page.set_default_timeout(WAIT_MS)
    return page


def track(lang: str) -> str:
    return f'.track[data-lang="{lang}"]'


async def lines(page: Page, lang: str = "en") -> list[str]:
    return await page.locator(f"{track(lang)} .line").all_inner_texts()


async def until_seq(page: Page, seq: int, lang: str = "en") -> None:
    """Wait until the overlay has handled the publication `seq` of `lang`."""
    await page.wait_for_function(
        "([sel, seq]) => { const t = document.querySelector(sel);"
        " return t !== null && Number(t.dataset.lastSeq) >= seq; }",
        arg=[track(lang), seq], timeout=WAIT_MS)


async def until_live(page: Page, lang: str = "en") -> None:
    await page.wait_for_selector(f'{track(lang)}[data-state="live"]', timeout=WAIT_MS)


async def show(page: Page, bus: RedisBus, segs: list[CaptionSegment]) -> None:
    for seg in segs:
        await bus.publish_caption(seg)
    await until_seq(page, segs[-1].seq, segs[-1].lang)


async def publish_until_shown(page: Page, bus: RedisBus, seqs: itertools.count[int],
                              text: str) -> str:
    """A page that joins at the live edge shows what is published after the gateway
    subscribed for it, a moment the page cannot see: publish finals until one shows.
    Returns the text shown."""
    for attempt in range(50):
        seq = next(seqs)
        shown = f"{text} {attempt}"
        await bus.publish_caption(caption(seq, 1000 + seq, shown, 50.0, 51.0))
        try:
            await page.wait_for_function(
                "([sel, seq]) => Number(document.querySelector(sel).dataset.lastSeq) >= seq",
                arg=[track("en"), seq], timeout=300)
        except PlaywrightTimeout:
            continue
        return shown
    pytest.fail("the overlay never showed a caption published at the live edge")


async def test_captions_appear_interims_grow_and_finals_replace_them(
    browser: Browser, gateway: Gateway, bus: RedisBus
) -> None:
    page = await new_page(browser)
    await page.goto(f"{gateway.base}/overlay/hall?lang=en&since=0")
    await until_live(page)
    await show(page, bus, [caption(1, 1, "Good", 0.0, 0.4, final=False)])
    assert await lines(page) == ["Good"]
    assert await page.locator(f"{track('en')} .line.interim").count() == 1
    await show(page, bus, [caption(2, 1, "Good morning", 0.0, 0.9, final=False)])
    assert await lines(page) == ["Good morning"]
    await show(page, bus, [caption(3, 1, "Good morning, everyone.", 0.0, 1.5)])
    assert await lines(page) == ["Good morning, everyone."]
    assert await page.locator(f"{track('en')} .line.interim").count() == 0

    await show(page, bus, [caption(4, 2, "Today we", 2.0, 2.5, final=False)])
    assert await lines(page) == ["Good morning, everyone.", "Today we"]
    await show(page, bus, [caption(5, 2, "Today we talk about captions.", 2.0, 4.0),
                           caption(6, 3, "Third sentence.", 4.5, 5.0)])
    # Two lines scroll: the oldest left the screen.
    assert await lines(page) == ["Today we talk about captions.", "Third sentence."]

    box = await page.locator(track("en")).bounding_box()
    assert box is not None
    assert box["x"] < 1280 * 0.1, "left-aligned"
    assert box["y"] + box["height"] > 720 * 0.8, "at the bottom of the frame"
    background = await page.evaluate(
        "getComputedStyle(document.documentElement).backgroundColor")
    assert background == "rgba(0, 0, 0, 0)", "transparent for OBS"
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "overlay.png"), omit_background=True)


async def test_a_withdrawn_interim_leaves_the_screen_and_never_comes_back(
    browser: Browser, gateway: Gateway, bus: RedisBus
) -> None:
    page = await new_page(browser)
    await page.goto(f"{gateway.base}/overlay/hall?lang=en&since=0")
    await until_live(page)
    await show(page, bus, [caption(1, 1, "Had he married.", 0.0, 1.0),
                           caption(2, 2, "And Mr. John", 1.5, 2.2, final=False)])
    assert await lines(page) == ["Had he married.", "And Mr. John"]
    withdraw = replace(caption(3, 2, "", 1.5, 2.2, final=False), lines=(), withdrawn=True)
    await show(page, bus, [withdraw])
    # The interim is gone and the final before it stays: no empty caption replaced it.
    assert await lines(page) == ["Had he married."]
    assert await page.locator(f"{track('en')} .line.interim").count() == 0
    # A reload resumes after the withdraw and shows the same screen.
    await page.reload()
    await until_live(page)
    assert await lines(page) == ["Had he married."]
    await show(page, bus, [caption(4, 3, "Dashwood.", 2.5, 3.0)])
    assert await lines(page) == ["Had he married.", "Dashwood."]


async def test_reload_resumes_exactly_without_repeating_or_skipping(
    browser: Browser, gateway: Gateway, bus: RedisBus
) -> None:
    url = f"{gateway.base}/overlay/hall?lang=en&since=0&lines=10"
    texts = [f"Sentence number {i}." for i in range(1, 8)]
    page = await new_page(browser)
    await page.goto(url)
    await until_live(page)
    await show(page, bus, [caption(i, i, texts[i - 1], i, i + 0.5) for i in (1, 2, 3)])
    assert await lines(page) == texts[:3]

    # The page goes away (OBS switches scenes) while captions go on.
    await page.goto("about:blank")
    await bus.publish_caption(caption(4, 4, "Sentence", 4.0, 4.2, final=False))
    await bus.publish_caption(caption(5, 4, texts[3], 4.0, 4.5))
    await bus.publish_caption(caption(6, 5, texts[4], 5.0, 5.5))
    await page.goto(url)  # the same URL: the saved position wins over since=0
    await until_seq(page, 6)
    assert await lines(page) == texts[:5]

    # A plain reload, right after a caption.
    await bus.publish_caption(caption(7, 6, texts[5], 6.0, 6.5))
    await until_seq(page, 7)
    await page.reload()
    await until_live(page)
    assert await lines(page) == texts[:6], "the screen is back as it was"
    await show(page, bus, [caption(8, 7, texts[6], 7.0, 7.5)])
    assert await lines(page) == texts


async def test_url_parameters_change_the_rendering(
    browser: Browser, gateway: Gateway, bus: RedisBus
) -> None:
    for seg in [caption(1, 1, "Good morning, everyone.", 0.0, 1.5),
                caption(2, 2, "Welcome to the main hall.", 2.0, 3.5)]:
        await bus.publish_caption(seg)
    for seg in [caption(1, 1, "Bonjour à tous.", 0.0, 1.5, lang="fr"),
                caption(2, 2, "Bienvenue dans la grande salle.", 2.0, 3.5, lang="fr")]:
        await bus.publish_caption(seg)

    page = await new_page(browser)
    await page.goto(f"{gateway.base}/overlay/hall?lang=en&since=0")
    await until_seq(page, 2)
    default = await page.evaluate(
        "(() => { const t = document.querySelector('.track[data-lang=\"en\"]');"
        " const s = getComputedStyle(t); return [s.fontSize, s.color,"
        " getComputedStyle(t.querySelector('span')).backgroundColor,"
        " document.getElementById('captions').className]; })()")
    assert default == ["40px", "rgb(255, 255, 255)", "rgba(0, 0, 0, 0)", "outlined"]

    await page.goto(f"{gateway.base}/overlay/hall?lang=en&lang2=fr&since=0&size=64&size2=48"
                    "&color=ff0000&color2=lime&bg=000000cc&lines=1&align=center")
    await until_seq(page, 2, "en")
    await until_seq(page, 2, "fr")
    assert await lines(page, "en") == ["Welcome to the main hall."], "one line"
    assert await lines(page, "fr") == ["Bienvenue dans la grande salle."]
    styled = await page.evaluate(
        "[...document.querySelectorAll('.track')].map(t => { const s = getComputedStyle(t);"
        " return [t.dataset.lang, s.fontSize, s.color, s.textAlign,"
        " getComputedStyle(t.querySelector('span')).backgroundColor]; })")
    assert styled == [
        ["en", "64px", "rgb(255, 0, 0)", "center", "rgba(0, 0, 0, 0.8)"],
        ["fr", "48px", "rgb(0, 255, 0)", "center", "rgba(0, 0, 0, 0.8)"],
    ]
    en_box = await page.locator(track("en")).bounding_box()
    fr_box = await page.locator(track("fr")).bounding_box()
    assert en_box is not None and fr_box is not None and en_box["y"] < fr_box["y"]
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "overlay-two-languages.png"),
                          omit_background=True)


async def test_translations_show_each_segment_once_in_arrival_order_broken_like_archives(
    browser: Browser, gateway: Gateway, bus: RedisBus
) -> None:
    long_fr = ("Pourquoi personne ne nous a prévenus hier soir que la réunion "
               "de la commission était reportée ?")
    page = await new_page(browser)
    await page.goto(f"{gateway.base}/overlay/hall?lang=fr&since=0&lines=10")
    await until_live(page, "fr")
    await show(page, bus, [
        caption(1, 2, "Bienvenue dans la grande salle.", 2.0, 3.5, lang="fr"),
        caption(2, 1, "Bonjour à tous.", 0.0, 1.5, lang="fr"),
        caption(3, 2, "Bienvenue dans la salle.", 2.0, 3.5, lang="fr"),  # repeated
        caption(4, 3, "", 4.0, 5.0, lang="fr", error="translation_failed"),
        caption(5, 4, long_fr, 6.0, 9.0, lang="fr"),
    ])
    assert await lines(page, "fr") == [
        "Bienvenue dans la grande salle.", "Bonjour à tous.", *wrap(long_fr, 42, "fr")]
    assert wrap(long_fr, 42, "fr")[-1].endswith(" ?"), "the example keeps '?' with its word"


async def test_nothing_stale_is_shown_after_a_long_disconnect(
    browser: Browser, redis_url: str, bus: RedisBus
) -> None:
    port = free_port()
    gw = await start_gateway(redis_url, [hall()], port=port)
    seqs = itertools.count(1)
    try:
        page = await new_page(browser)
        await page.goto(f"{gw.base}/overlay/hall?lang=en&since=0&stale=1")
        await until_live(page)
        await show(page, bus, [caption(next(seqs), 1, "Before the outage.", 0.0, 1.0)])
        await gw.stop()
        # Longer than `stale` without a connection: the screen empties.
        await page.wait_for_selector(f'{track("en")}[data-state="connecting"]')
        await page.wait_for_function(
            "sel => document.querySelector(sel).childElementCount === 0", arg=track("en"))
        await bus.publish_caption(caption(next(seqs), 2, "Said during the outage.", 2.0, 3.0))
        gw = await start_gateway(redis_url, [hall()], port=port)
        await until_live(page)
        shown = await publish_until_shown(page, bus, seqs, "After the outage")
        assert await lines(page) == [shown], "nothing from before or during the outage"

        # A saved position older than `stale` is not resumed either. (The overlay saves
        # when it is left, so age the save from another page of the gateway.)
        await page.goto(f"{gw.base}/healthz")
        await page.evaluate("""() => { const k = 'babelcast:overlay:hall:en';
            const s = JSON.parse(localStorage.getItem(k)); s.aliveAt = 0;
            localStorage.setItem(k, JSON.stringify(s)); }""")
        await bus.publish_caption(caption(next(seqs), 3, "Old news.", 60.0, 61.0))
        await page.goto(f"{gw.base}/overlay/hall?lang=en&stale=1")
        await until_live(page)
        assert await lines(page) == []
        shown = await publish_until_shown(page, bus, seqs, "Live again")
        assert await lines(page) == [shown]
    finally:
        await gw.stop()


async def test_a_new_event_on_the_same_redis_resets_a_saved_position(
    browser: Browser, gateway: Gateway, bus: RedisBus
) -> None:
    page = await new_page(browser)
    url = f"{gateway.base}/overlay/hall?lang=en&since=0"
    await page.goto(url)
    await until_live(page)
    await show(page, bus, [caption(i, i, f"Yesterday {i}.", i, i + 0.5) for i in (1, 2, 3)])
    await page.goto("about:blank")
    await bus.redis.flushdb()  # the next event starts its captions at seq 1 again
    await bus.publish_caption(caption(1, 1, "Today one.", 0.0, 1.0))
    await page.goto(url)  # resumes with since=3: past the newest caption
    await page.wait_for_function(
        "sel => document.querySelector(sel).dataset.lastSeq === '0'", arg=track("en"))
    assert await lines(page) == []
    shown = await publish_until_shown(page, bus, itertools.count(2), "Today")
    assert await lines(page) == [shown]


async def test_index_links_to_every_overlay_and_missing_lang_is_filled_in(
    browser: Browser, gateway: Gateway
) -> None:
    async with httpx.AsyncClient(base_url=gateway.base, timeout=10) as http:
        index = await http.get("/")
        assert index.status_code == 200
        for href in ('/overlay/hall?lang=en"', '/overlay/hall?lang=fr"',
                     '/overlay/hall?lang=en&amp;lang2=fr"', '/hls/hall/fr.m3u8"'):
            assert href in index.text
        redirect = await http.get("/overlay/hall?size=50")
        assert redirect.status_code == 307
        assert redirect.headers["location"] == "/overlay/hall?size=50&lang=en"
        assert (await http.get("/overlay/nowhere?lang=en")).status_code == 404
        wrong = await http.get("/overlay/hall?lang=de")
        assert wrong.status_code == 404 and "en, fr" in wrong.text
        for asset in ("/static/overlay.js", "/static/overlay.css", "/static/linebreak.js"):
            assert (await http.get(asset)).status_code == 200

    page = await new_page(browser)
    await page.goto(gateway.base + "/")
    await page.click("text=en + fr")
    await until_live(page, "en")
    await until_live(page, "fr")
    assert page.url.endswith("/overlay/hall?lang=en&lang2=fr")


async def test_an_overlay_url_with_a_viewer_token_shows_captions_and_one_without_is_refused(
    browser: Browser, redis_url: str, bus: RedisBus
) -> None:
    """Viewers need tokens here (no `auth.viewers: public`): the URL OBS is given carries
    one; the page sends it as the socket's subprotocol, never in the socket's URL."""
    key = b"v" * 48
    security = GatewaySecurity(Authenticator(GatewaySecrets(admin=ADMIN_TOKEN, signing_key=key),
                                             viewers_public=False))
    english = mint_viewer_token(key, streams=["hall"], langs=["en"], ttl_s=600, subject="obs")
    async with running_gateway(redis_url, [hall(("fr",))], security=security) as gw:
        page = await new_page(browser)
        sockets: list[str] = []
        page.on("websocket", lambda ws: sockets.append(ws.url))
        loaded = await page.goto(f"{gw.base}/overlay/hall?lang=en&since=0&token={english}")
        assert loaded is not None and loaded.status == 200
        await until_live(page)
        await show(page, bus, [caption(1, 1, "Good morning, everyone.", 0.0, 1.5)])
        assert await lines(page) == ["Good morning, everyone."]
        assert sockets and not any(english in url for url in sockets)

        refused = await new_page(browser)
        for url, status in ((f"{gw.base}/overlay/hall?lang=en", 401),  # no token
                            (f"{gw.base}/overlay/hall?lang=en&token=forged.x.y", 401),
                            (f"{gw.base}/overlay/hall?lang=fr&token={english}", 403)):
            answer = await refused.goto(url)
            assert answer is not None and answer.status == status, url
            assert await refused.locator(".track").count() == 0, "no overlay was served"
            assert "token" in await refused.inner_text("body")

        # A token that runs out while the page is open: the socket is closed (4401), the
        # overlay says why and shows nothing new.
        brief = mint_viewer_token(key, streams=["hall"], langs=["en"], ttl_s=5, subject="obs")
        expiring = await new_page(browser)
        await expiring.goto(f"{gw.base}/overlay/hall?lang=en&token={brief}")
        await until_live(expiring)
        await expiring.wait_for_selector(f'{track("en")}[data-error="token_expired"]',
                                         timeout=15_000)
        await bus.publish_caption(caption(2, 2, "Said after it expired.", 2.0, 3.0))
        await until_seq(page, 2)  # the page with a valid token got it
        assert "Said after it expired." not in await lines(expiring)


def test_overlay_assets_need_nothing_from_outside() -> None:
    static = Path(__file__).resolve().parent.parent / "orchestrator" / "gateway" / "static"
    for path in static.iterdir():
        text = path.read_text(encoding="utf-8")
        assert "http://" not in text and "https://" not in text, f"{path.name} loads remotely"
        assert "@import" not in text and "@font-face" not in text
