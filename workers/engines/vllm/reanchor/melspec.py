"""Voxtral's log-mel spectrogram without a wait on the GPU for every audio item.

vLLM 0.26's `VoxtralEncoderModel.compute_whisper_melspec` (model_executor/models/voxtral.py)
runs once per audio item of a step, so once per session's 80 ms chunk. Each time it makes
the model's constant `global_log_mel_max` into a new device tensor, `torch.tensor(x,
device=...)`. That is a copy from host memory, and the copy waits until the stream has
finished everything queued before it, including the previous step's forward that async
scheduling means to overlap. On the H200 (2026-12-01, four engines, production feed) 19.7 %
of the engine-core processes' samples sat on that one line.

`switch(model, True)` gives every such encoder of the model an instance method that does
the same operations in the same order, with the floor (`global_log_mel_max - 8.0`) and the
Hann window made once per device (and dtype) instead of once per chunk. It is switched on
only where a check on the model's own device gives a bitwise-equal spectrogram;
`switch(model, False)` restores vLLM's method.
Used by the engine-core worker (`worker.ReanchorWorker.babelcast_melspec`).
"""

from __future__ import annotations

from typing import Any

import torch

CHECK_SAMPLES = 2160
"""Samples of the check waveform: one chunk as the direct builder sends it (80 ms plus the
encoder's look-back)."""
ATTR = "compute_whisper_melspec"


class SyncFreeMelspec:
    """`compute_whisper_melspec` for one encoder, the constant floor made once."""

    def __init__(self, encoder: Any, global_max: float) -> None:
        self.encoder = encoder
        self.global_max = global_max
        self._floors: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._windows: dict[torch.device, torch.Tensor] = {}

    def _floor(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.device, like.dtype)
        floor = self._floors.get(key)
        if floor is None:  # the one host-to-device copy, and the same arithmetic as vLLM's
            top = torch.tensor(self.global_max, device=like.device, dtype=like.dtype)
            floor = self._floors[key] = top - 8.0
        return floor

    def __call__(self, audio_waveforms: torch.Tensor) -> torch.Tensor:
        cfg = self.encoder.config
        input_dtype = audio_waveforms.dtype
        window = self._windows.get(audio_waveforms.device)
        if window is None:  # the same call as vLLM's, once
            window = self._windows[audio_waveforms.device] = torch.hann_window(
                cfg.window_size, device=audio_waveforms.device)
        stft = torch.stft(audio_waveforms, cfg.window_size, cfg.hop_length, window=window,
                          return_complex=True)
        magnitudes = stft[..., :-1].abs() ** 2
        mel_spec = self.encoder.mel_filters.T @ magnitudes
        log_spec = torch.clamp(mel_spec, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, self._floor(log_spec))
        log_spec = (log_spec + 4.0) / 4.0
        return log_spec.to(input_dtype)


def _encoders(model: torch.nn.Module) -> list[Any]:
    return [m for m in model.modules()
            if callable(getattr(type(m), ATTR, None)) and hasattr(m, "mel_filters")
            and hasattr(m, "config")]


def switch(model: torch.nn.Module, on: bool) -> dict[str, Any]:
    """Put the sync-free spectrogram on (or vLLM's back on) every Voxtral encoder of
    `model`. Says how many encoders it switched, and why not where it did not."""
    encoders = _encoders(model)
    if not encoders:
        return {"on": False, "encoders": 0, "why_not": "no Voxtral encoder in the model"}
    if not on:
        for enc in encoders:
            enc.__dict__.pop(ATTR, None)
        return {"on": False, "encoders": len(encoders), "why_not": None}
    checked = []
    for enc in encoders:
        top = getattr(enc.config, "global_log_mel_max", None)
        if not isinstance(top, float):  # vLLM then takes each item's own max: keep it
            return {"on": False, "encoders": len(encoders),
                    "why_not": f"global_log_mel_max is {top!r}, not a float"}
        ours = SyncFreeMelspec(enc, top)
        device = enc.mel_filters.device
        wave = torch.randn(CHECK_SAMPLES, generator=torch.Generator().manual_seed(7)) * 0.1
        wave = wave.to(device)
        with torch.inference_mode():
            theirs = getattr(type(enc), ATTR)(enc, wave)
            mine = ours(wave)
        if theirs.dtype != mine.dtype or not torch.equal(theirs, mine):
            return {"on": False, "encoders": len(encoders),
                    "why_not": "the check waveform's spectrogram differs from vLLM's"}
        checked.append((enc, ours))
    for enc, ours in checked:  # all or none
        enc.__dict__[ATTR] = ours
    return {"on": True, "encoders": len(encoders), "why_not": None}
