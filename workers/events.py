"""Plain data that travels inside a process and across Ray actor boundaries.

Frozen, slotted dataclasses only: they pickle cheaply and cannot be mutated by a
consumer behind a producer's back. Wire formats (JSON on Redis and WebSockets)
are produced by `workers.bus`, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SAMPLE_RATE = 16_000
"""Every audio chunk inside Babelcast is PCM16 little-endian, mono, 16 kHz."""

BYTES_PER_SAMPLE = 2


@dataclass(frozen=True, slots=True)
class AudioChunk:
    """A piece of a stream's audio, as written to `audio:{stream}`.

    `pos` counts samples since the stream started (the stream's audio clock);
    `wall` is the epoch time at which the chunk's *end* was captured, which is
    what speech→caption latency is measured against.
    """

    stream: str
    pos: int
    pcm: bytes
    wall: float
    speech: tuple[bool, ...] | None = None
    """Voice activity already computed for this audio (one flag per 512-sample frame that
    completed in it), so an engine session does not run Silero a second time; None: not
    computed (the session runs its own)."""
    speech_end: int | None = None
    """Stream position where the last of `speech`'s frames ends. The VAD's frames run on
    from where it started, not from each chunk's start, so up to 511 samples of a chunk
    can wait for the next one; None: at the chunk's end."""

    @property
    def samples(self) -> int:
        return len(self.pcm) // BYTES_PER_SAMPLE

    @property
    def start_s(self) -> float:
        return self.pos / SAMPLE_RATE

    @property
    def end_s(self) -> float:
        return (self.pos + self.samples) / SAMPLE_RATE


SOURCE_ENDED = "source-ended"
"""`AudioGap.reason` of the marker an ingest writes when a stream's source has ended for
good (a file, an HLS playlist that ended): the ASR side finishes the stream's session and
frees it, instead of feeding it filler for as long as the event runs."""


@dataclass(frozen=True, slots=True)
class AudioGap:
    """A hole in a stream's audio (source down, reconnecting, dropped frames).

    Recorded in the audio Stream so the ASR side closes what it had instead of
    gluing audio from both sides of the hole together. `pos` is the audio clock
    after the gap; `duration_s` is how much wall time the hole lasted.
    """

    stream: str
    pos: int
    duration_s: float
    reason: str
    wall: float


@dataclass(frozen=True, slots=True)
class Word:
    text: str
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class TranscriptDelta:
    """What an engine session emits.

    `committed` words are stable: an engine never takes them back. `tentative`
    is the engine's current guess for the audio after them; each delta replaces
    the previous tentative words. `end_of_utterance` says the speaker paused, so
    whatever is open may be closed. Times are stream audio seconds.
    """

    committed: tuple[Word, ...] = ()
    tentative: tuple[Word, ...] = ()
    end_of_utterance: bool = False
    language: str | None = None
    skipped: tuple[float, float] | None = None
    """Stream seconds (start, end) of audio that will never be captioned: the session
    manager skipped it to catch up with the live edge (its shedding policy). Published
    as a `gap` event after whatever was open is closed."""


@dataclass(frozen=True, slots=True)
class CaptionSegment:
    """One published caption state (partial or final) of one segment.

    `seq` increases by one per publication on (stream, lang); a client that
    saw seq N resumes with `since=N`. `revision` counts publications of the
    same `segment_id`. A final is never revised. `stable_prefix_len` is how
    many characters of `text` will not change any more.
    """

    stream: str
    lang: str
    segment_id: int
    seq: int
    revision: int
    is_final: bool
    text: str
    stable_prefix_len: int
    lines: tuple[str, ...]
    audio_start_s: float
    audio_end_s: float
    audio_end_wall: float
    emit_time: float
    error: str | None = None
    source_lang: str | None = None
    """Set on translations: the language of the caption this one translates. A
    translation carries the `segment_id` of its source segment and its own `seq`."""
    withdrawn: bool = False
    """A withdraw, not a caption: the interim shown for `segment_id` could not be made
    final (its session was replaced, failed or ended before the words were confirmed)
    and is taken off screen. It has no text, is not final, and closes the segment (no
    publication follows for that id). On the wire its `type` is "withdraw". A final
    always has text and audio times; an empty final is never published."""
    gap_s: float = 0.0
    """A gap event, not a caption: the audio from `audio_start_s` to `audio_end_s` (this
    many seconds) was skipped and will never be captioned (the stream was further behind
    than its shedding bound). No text, not final; on the wire its `type` is "gap"."""


@dataclass(frozen=True, slots=True)
class TranslationJob:
    """One finished source sentence to translate into every target language.

    Enqueued by the ASR side on `mt:jobs` when a segment turns final. `context` is
    the stream's previous final sentences (oldest first), for translators that use
    context. `source_emit_time` is when the source final was published, so the
    translation's lag can be measured. `is_final` is False for an optional
    live-tail job, whose translation is published as a non-final caption.
    """

    stream: str
    segment_id: int
    seq: int
    text: str
    source_lang: str
    targets: tuple[str, ...]
    context: tuple[str, ...]
    audio_start_s: float
    audio_end_s: float
    audio_end_wall: float
    source_emit_time: float
    is_final: bool = True


@dataclass(frozen=True, slots=True)
class StreamOptions:
    """What the ASR and ingest hosts need to know about one stream.

    Built by the orchestrator from the event YAML; the floors below never see
    the YAML models.
    """

    stream_id: str
    name: str
    source: str
    language: str = "auto"
    targets: tuple[str, ...] = ()
    loop: bool = False
    context_sentences: int = 3
    """How many previous final sentences travel with a translation job."""
    partials_every_s: float | None = None
    """Also translate the open segment (as non-final) at most this often; None: finals only."""
    key: str = field(default="", repr=False)
    """The stream key an RTMP listener checks, or the SRT passphrase: a secret the
    orchestrator read from the stream's `key_env`. Kept out of repr; never logged."""
    tls_cert: str = ""
    """rtmps listener: certificate chain file (PEM)."""
    tls_key: str = ""
    """rtmps listener: private key file (PEM)."""
    hls_start_segments: int = 1
    """HLS: start this many segments from the live edge (1: the newest)."""

    @property
    def caption_lang(self) -> str:
        """The language code under which source-language captions are published."""
        return self.language if self.language != "auto" else "src"
