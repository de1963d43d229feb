"""The engine core's sync-free spectrogram (workers/engines/vllm/reanchor/melspec.py) on the
CPU: it gives vLLM 0.26's spectrogram bit for bit and makes its device constant once, not
once per chunk. vLLM cannot run here, so the encoder is a STAND-IN whose method is vLLM
0.26's `VoxtralEncoderModel.compute_whisper_melspec` as read (model_executor/models/
voxtral.py, lines 754-786); on the H200 the switch checks itself against the real one."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from workers.engines.vllm.reanchor import melspec

pytestmark = pytest.mark.unit


class StandInVoxtralEncoder(torch.nn.Module):
    """STAND-IN for vLLM 0.26's VoxtralEncoderModel: its spectrogram method only."""

    def __init__(self, global_log_mel_max: Any = 1.5) -> None:
        super().__init__()
        self.config = SimpleNamespace(window_size=400, hop_length=160, num_mel_bins=128,
                                      global_log_mel_max=global_log_mel_max)
        rng = np.random.default_rng(3)  # any non-negative filter bank does
        self.mel_filters = torch.tensor(rng.random((201, 128)) / 50, dtype=torch.float32)

    def compute_whisper_melspec(self, audio_waveforms: torch.Tensor) -> torch.Tensor:
        input_dtype = audio_waveforms.dtype
        window = torch.hann_window(self.config.window_size, device=audio_waveforms.device)
        stft = torch.stft(audio_waveforms, self.config.window_size, self.config.hop_length,
                          window=window, return_complex=True)
        magnitudes = stft[..., :-1].abs() ** 2
        mel_spec = self.mel_filters.T @ magnitudes
        log_spec = torch.clamp(mel_spec, min=1e-10).log10()
        if global_log_mel_max := self.config.global_log_mel_max:
            if not isinstance(global_log_mel_max, float):
                raise TypeError(f"{global_log_mel_max=} needs to be of type float.")
            log_spec_max = torch.tensor(global_log_mel_max, device=log_spec.device,
                                        dtype=log_spec.dtype)
        else:
            log_spec_max = log_spec.max()
        log_spec = torch.maximum(log_spec, log_spec_max - 8.0)
        log_spec = (log_spec + 4.0) / 4.0
        return log_spec.to(input_dtype)


class Model(torch.nn.Module):
    def __init__(self, *encoders: torch.nn.Module) -> None:
        super().__init__()
        self.encoders = torch.nn.ModuleList(encoders)


def waves() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randn(n, generator=g) * scale for n, scale in
            ((2160, 0.1), (2160, 1e-6), (12000, 0.5), (2160, 0.0))]


def test_switched_on_it_gives_vllms_spectrogram_bit_for_bit() -> None:
    enc = StandInVoxtralEncoder()
    expected = [enc.compute_whisper_melspec(w) for w in waves()]
    answer = melspec.switch(Model(enc), True)
    assert answer == {"on": True, "encoders": 1, "why_not": None}
    assert isinstance(enc.compute_whisper_melspec, melspec.SyncFreeMelspec)
    for w, want in zip(waves(), expected, strict=True):
        got = enc.compute_whisper_melspec(w)
        assert got.dtype == want.dtype and torch.equal(got, want)
    # silence reaches the floor: the constant is used, not each chunk's own max
    assert torch.equal(expected[3], torch.full_like(expected[3], (1.5 - 8.0 + 4.0) / 4.0))


def counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Any]:
    """Calls of torch.<name> from now on (their positional arguments)."""
    calls: list[Any] = []
    real = getattr(torch, name)

    def counting(*args: Any, **kw: Any) -> Any:
        calls.append(args)
        return real(*args, **kw)

    monkeypatch.setattr(torch, name, counting)
    return calls


def test_it_makes_its_device_constant_once_not_once_per_chunk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    enc = StandInVoxtralEncoder()
    melspec.switch(Model(enc), True)
    made = counted(monkeypatch, "tensor")
    for w in waves() * 3:
        enc.compute_whisper_melspec(w)
    assert made == []  # the switch's own check already made the float32 one
    windows = counted(monkeypatch, "hann_window")
    for w in waves():
        enc.compute_whisper_melspec(w)
    assert windows == []  # nor a window per chunk
    StandInVoxtralEncoder.compute_whisper_melspec(enc, waves()[0])
    assert len(made) == 1  # vLLM's makes one per call


def test_switched_off_vllms_method_is_back() -> None:
    enc = StandInVoxtralEncoder()
    model = Model(enc)
    melspec.switch(model, True)
    assert melspec.switch(model, False) == {"on": False, "encoders": 1, "why_not": None}
    assert "compute_whisper_melspec" not in enc.__dict__
    bound: Any = enc.compute_whisper_melspec
    assert bound.__func__ is StandInVoxtralEncoder.compute_whisper_melspec


def test_an_encoder_that_takes_each_chunks_own_max_keeps_vllms_method() -> None:
    enc = StandInVoxtralEncoder(global_log_mel_max=None)
    answer = melspec.switch(Model(enc), True)
    assert answer["on"] is False and "not a float" in answer["why_not"]
    assert "compute_whisper_melspec" not in enc.__dict__


def test_all_encoders_or_none() -> None:
    class Drifting(StandInVoxtralEncoder):
        def compute_whisper_melspec(self, audio_waveforms: torch.Tensor) -> torch.Tensor:
            return super().compute_whisper_melspec(audio_waveforms) + 1e-7

    good, odd = StandInVoxtralEncoder(), Drifting()
    answer = melspec.switch(Model(good, odd), True)
    assert answer["on"] is False and "differs" in answer["why_not"]
    assert "compute_whisper_melspec" not in good.__dict__
    assert melspec.switch(torch.nn.Linear(2, 2), True)["encoders"] == 0
