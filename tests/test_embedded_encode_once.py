"""A `language: auto` decode encodes its window once (issue 37: other languages' finals
came 3.5-5.7 s late; every final pass of an `auto` stream paid Whisper's encoder twice,
once to detect the language and once to decode). Whisper base on Debian's French Asterisk
prompts (`tests.speech.prompts_talk`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from faster_whisper import WhisperModel

from tests.speech import normalize_any, prompts_talk
from workers.engines.models import load_whisper

pytestmark = pytest.mark.integration


def test_language_detection_and_decoding_share_one_encode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_whisper("whisper-base", cpu_threads=2)
    encodes: list[tuple[int, ...]] = []
    original = WhisperModel.encode

    def counted(self: Any, features: Any) -> Any:
        encodes.append(tuple(features.shape))
        return original(self, features)

    monkeypatch.setattr(WhisperModel, "encode", counted)
    pcm = prompts_talk("fr", 12.0).pcm
    audio = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    first, second = audio[: 6 * 16000], audio[6 * 16000 : 12 * 16000]

    def text(clip: np.ndarray, language: str | None) -> tuple[str, str]:
        model.encode_frames = 3000
        segments, info = model.transcribe(clip, language=language, beam_size=1,
                                          condition_on_previous_text=False,
                                          vad_filter=False, temperature=0.0)
        return normalize_any("".join(s.text for s in segments)), info.language

    auto, lang = text(first, None)
    assert lang == "fr"
    assert len(encodes) == 1, f"detection and decoding encoded {len(encodes)} times"
    declared, _ = text(first, "fr")
    assert declared == auto
    # The control: other audio is encoded afresh, never answered from the memo.
    encodes.clear()
    other, _ = text(second, "fr")
    assert len(encodes) == 1 and other and other != declared
