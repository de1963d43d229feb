"""Model folders for the GPU tier: Voxtral Mini 4B Realtime's published architecture as
params.json + tekken.json (vLLM fills random weights with load_format="dummy"), and a
variant whose decoder window is short, so sessions leave the window — and re-anchor —
within seconds instead of 11 minutes. Everything else (layers, widths, the audio encoder
and its 750-frame window, the tokenizer) is the real model's.

    python -m tests.gpu.voxtral_model OUT_DIR [--window N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

PARAMS = {
    "dim": 3072, "n_layers": 26, "head_dim": 128, "hidden_dim": 9216, "n_heads": 32,
    "n_kv_heads": 8, "use_biases": False, "causal": True, "rope_theta": 1000000.0,
    "norm_eps": 1e-05, "vocab_size": 131072, "model_parallel": 1, "tied_embeddings": True,
    "sliding_window": 8192, "model_max_length": 131072, "max_position_embeddings": 131072,
    "multimodal": {"whisper_model_args": {
        "encoder_args": {
            "audio_encoding_args": {
                "sampling_rate": 16000, "frame_rate": 12.5, "num_mel_bins": 128,
                "hop_length": 160, "window_size": 400, "chunk_length_s": None,
                "global_log_mel_max": 1.5, "transcription_format": "streaming"},
            "dim": 1280, "n_layers": 32, "head_dim": 64, "hidden_dim": 5120, "n_heads": 32,
            "vocab_size": 131072, "n_kv_heads": 32, "use_biases": True, "use_cache": False,
            "rope_theta": 1000000.0, "causal": True, "norm_eps": 1e-05, "pos_embed": "rope",
            "max_source_positions": None, "ffn_type": "swiglu", "norm_type": "rms_norm",
            "sliding_window": 750},
        "downsample_args": {"downsample_factor": 4}}},
    "ada_rms_norm_t_cond": True,
    "ada_rms_norm_t_cond_dim": 32,
}

TEKKEN_AUDIO = {
    "sampling_rate": 16000, "frame_rate": 12.5,
    "audio_encoding_config": {"num_mel_bins": 128, "hop_length": 160, "window_size": 400},
    "chunk_length_s": None, "transcription_format": "streaming",
    "transcription_delay_ms": 480, "streaming_look_ahead_ms": 2.5,
    "streaming_look_back_ms": 52.5, "streaming_n_left_pad_tokens": 32,
}

# Special tokens: ranks 0..19 are mistral_common's classic control tokens; [AUDIO]=24,
# [BEGIN_AUDIO]=25, [STREAMING_PAD]=32, [STREAMING_WORD]=33 ... (ranks must be contiguous).
_CLASSIC = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]",
            "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]",
            "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]"]
_NAMED = {24: "[AUDIO]", 25: "[BEGIN_AUDIO]", 32: "[STREAMING_PAD]", 33: "[STREAMING_WORD]",
          34: "[REPEAT_AUDIO_TEXT]", 35: "[NEXT_AUDIO_TEXT]", 36: "[TRANSCRIBE]"}


def _special_tokens() -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for rank in range(max(_NAMED) + 1):
        s = _CLASSIC[rank] if rank < len(_CLASSIC) else _NAMED.get(rank, f"<SPECIAL_{rank}>")
        out.append({"rank": rank, "token_str": s, "is_control": True})
    return out


def write_model(out_dir: str | Path, decoder_window: int = 8192) -> Path:
    """params.json + tekken.json (no weights) in out_dir; needs mistral_common (its
    packaged tekken vocabulary), which vLLM depends on."""
    import mistral_common

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = json.loads(json.dumps(PARAMS))
    params["sliding_window"] = decoder_window
    (out / "params.json").write_text(json.dumps(params, indent=2))
    base = Path(os.path.dirname(mistral_common.__file__)) / "data" / "tekken_240911.json"
    tk = json.loads(base.read_text())
    cfg = tk["config"]
    tk["config"]["version"] = "v7"  # audio needs >= v7
    tk["vocab"] = tk["vocab"][: cfg["default_vocab_size"] - cfg["default_num_special_tokens"]]
    tk["config"]["num_vocab_tokens"] = len(tk["vocab"])
    tk["special_tokens"] = _special_tokens()
    tk.pop("image", None)
    tk["audio"] = TEKKEN_AUDIO
    (out / "tekken.json").write_text(json.dumps(tk, ensure_ascii=False))
    return out


def short_window_copy(model_dir: str | Path, out_dir: str | Path, window: int) -> Path:
    """The model in `model_dir` with its decoder window set to `window` (weights, if
    any, are linked, not copied)."""
    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name == "params.json":
            params = json.loads(f.read_text())
            params["sliding_window"] = window
            (out / f.name).write_text(json.dumps(params, indent=2))
        elif not (out / f.name).exists():
            if f.suffix == ".json":
                shutil.copy(f, out / f.name)
            else:
                (out / f.name).symlink_to(f.resolve())
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--window", type=int, default=8192, help="decoder sliding window")
    a = ap.parse_args()
    print(write_model(a.out, a.window))
