"""Filling audio holes the way realtime models need: faint dithered noise, never zeros.

Exact digital silence makes realtime models hallucinate; a few LSB of triangular
dither is inaudible and keeps the model in its training distribution.
"""

from __future__ import annotations

import numpy as np

from workers.events import AudioChunk


class DitherNoise:
    def __init__(self, lsb: int = 2, seed: int | None = None) -> None:
        self.lsb = lsb
        self._rng = np.random.default_rng(seed)

    def pcm(self, samples: int) -> bytes:
        # Triangular (TPDF) dither: the sum of two uniform variables, within ±lsb.
        half = self.lsb / 2
        tri = self._rng.uniform(-half, half, samples) + self._rng.uniform(-half, half, samples)
        noise = np.clip(np.rint(tri), -self.lsb, self.lsb).astype("<i2")
        # Never all-zero, even for a tiny chunk.
        if samples and not noise.any():
            noise[0] = 1
        return noise.tobytes()

    def chunk(self, stream: str, pos: int, samples: int, wall: float) -> AudioChunk:
        return AudioChunk(stream, pos, self.pcm(samples), wall)
