"""Reference speech for tests and benchmarks: the five LibriVox utterances of the
pocketsphinx 5.1.1 source distribution (public domain), committed under examples/audio
as the two demo rooms, with their reference text."""

from __future__ import annotations

import re
import wave
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
AUDIO = ROOT / "examples" / "audio"

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
