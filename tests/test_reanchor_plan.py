"""The bookkeeping of one re-anchor (workers/engines/vllm/reanchor/plan.py) on plain
objects shaped like vLLM 0.26's scheduler objects: `Request`, the single-type KV cache
managers of a hybrid coordinator (Voxtral: the decoder's 8192-token window, the pooled
audio encoder's 189-position window), `KVCacheBlock`s with a shared null block, the
encoder cache manager, `PlaceholderRange`/`MultiModalFeatureSpec`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from workers.engines.vllm.reanchor.plan import (
    CannotReanchor,
    Geometry,
    apply,
    check,
    due,
    embedded_spans,
    geometry_of,
)

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class PlaceholderRange:
    offset: int
    length: int
    is_embed: object = None


@dataclass
class Feature:
    identifier: str
    mm_position: PlaceholderRange
    modality: str = "audio"


@dataclass(eq=False)
class Block:
    block_id: int
    is_null: bool = False


@dataclass
class Pool:
    freed: list[int] = field(default_factory=list)

    def free_blocks(self, blocks: list[Block]) -> None:
        self.freed.extend(b.block_id for b in blocks)


NULL = Block(0, is_null=True)


@dataclass
class Manager:
    block_size: int
    sliding_window: int | None
    req_to_blocks: dict[str, list[Block]] = field(default_factory=dict)
    num_cached_block: dict[str, int] = field(default_factory=dict)
    block_pool: Pool = field(default_factory=Pool)
    _null_block: Block = NULL


@dataclass
class EncoderCache:
    request_cached_ids: dict[str, set[int]] = field(default_factory=dict)
    freed: list[tuple[str, int]] = field(default_factory=list)

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        self.freed.append((request.request_id, input_id))
        self.request_cached_ids[request.request_id].discard(input_id)


@dataclass
class Request:
    request_id: str
    num_computed_tokens: int
    _all_token_ids: list[int]
    prompt_token_ids: list[int]
    num_prompt_tokens: int
    mm_features: list[Feature]
    num_output_placeholders: int = 0
    num_in_flight_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[object] = field(default_factory=list)
    prompt_embeds: object = None
    prompt_is_token_ids: object = None


_ids = iter(range(1, 10**9))


def blocks_for(n_tokens: int, block_size: int, window: int | None) -> list[Block]:
    """Blocks of a request with n computed tokens, the ones out of the window already
    freed to the null block (what SlidingWindowManager.remove_skipped_blocks does)."""
    count = -(-n_tokens // block_size)
    skipped = 0 if window is None else max(0, n_tokens - window + 1) // block_size
    return [NULL if i < skipped else Block(next(_ids)) for i in range(count)]


HOP = 160  # samples per mel frame
TOKEN_MEL_FRAMES = 8  # 16 kHz / 12.5 tokens per s / 160
CHUNK_SAMPLES = 1280 + 840 + 40  # an 80 ms frame with the buffer's look-back and look-ahead
FIRST_SAMPLES = 49960  # the first prompt: left pad, delay and the first frame


def placeholder_length(samples: int) -> int:
    """mistral_common 1.13.1 `AudioConfig.num_audio_tokens` (tokens/tokenizers/audio.py
    :462), which vLLM 0.26's `_maybe_apply_prompt_updates` uses for a realtime prompt's
    placeholder: mel frames rounded up, then tokens rounded up."""
    frames = (math.ceil(samples / HOP - 1) if samples % HOP else samples // HOP)
    return math.ceil(frames / TOKEN_MEL_FRAMES)


def embeddings_made(samples: int) -> int:
    """Rows vLLM 0.26's `VoxtralRealtimeGeneration.embed_multimodal` makes for a prompt's
    audio: STFT frames (centred: 1 + n // hop) less the last, an even number, the convs'
    stride 2, a multiple of the 4-frame pool, one row per 4 frames."""
    mel = 1 + samples // HOP - 1
    mel -= mel % 2
    conv = mel // 2
    return (conv - conv % 4) // 4


def test_placeholders_are_as_vllm_makes_them() -> None:
    """An 80 ms chunk's placeholder is 2 positions for 1 embedding; the first prompt's 39
    for 39; a bulk step of b frames b + 1 for b (bench.voxtral_age)."""
    assert (placeholder_length(CHUNK_SAMPLES), embeddings_made(CHUNK_SAMPLES)) == (2, 1)
    assert (placeholder_length(FIRST_SAMPLES), embeddings_made(FIRST_SAMPLES)) == (39, 39)
    bulk = 768 * 1280 + 840 + 40
    assert (placeholder_length(bulk), embeddings_made(bulk)) == (769, 768)


def chunk_feature(name: str, at: int, samples: int = CHUNK_SAMPLES) -> Feature:
    """A chunk's feature where `_update_request_as_session` puts it: at the request's
    length, with the placeholder length vLLM gives it."""
    return Feature(name, PlaceholderRange(at, placeholder_length(samples)))


def session(n: int, new: int = 1, managers: tuple[Manager, ...] = ()) -> Request:
    """A streaming request at a chunk boundary: n computed positions (the first prompt
    of 39 tokens, then one token per chunk), `new` positions of the next chunk queued;
    its features as vLLM 0.26 places them (2-position placeholders, overlapping)."""
    tokens = list(range(n + new))
    features = [Feature("f0", PlaceholderRange(0, placeholder_length(FIRST_SAMPLES)))]
    features += [chunk_feature(f"f{p}", p) for p in range(39, n + new)]
    req = Request("r", n, tokens, list(tokens), len(tokens), features)
    for m in managers:
        m.req_to_blocks["r"] = blocks_for(n, m.block_size, m.sliding_window)
        m.num_cached_block["r"] = len(m.req_to_blocks["r"])
    return req


def voxtral() -> tuple[Manager, Manager]:
    return Manager(block_size=128, sliding_window=8192), Manager(block_size=16,
                                                                 sliding_window=189)


def test_geometry_of_voxtral_groups() -> None:
    g = geometry_of(voxtral())
    assert g.unit == 128 and g.keep == 8191 and g.why_not() is None
    full = Geometry((16,), (None,))
    assert full.why_not() is not None
    with pytest.raises(CannotReanchor):
        _ = full.keep


def test_an_aged_session_holds_each_window_in_blocks_plus_the_one_being_filled() -> None:
    # The H200's KV trace: 65 decoder + 13 encoder blocks per aged session; 2,636 bf16 and
    # 5,117 fp8 blocks per engine (0.425 of the GPU each).
    g = geometry_of(voxtral())
    assert g.aged_blocks == 65 + 13
    assert g.sessions_by_kv(2636) == 33 and g.sessions_by_kv(5117) == 65
    assert g.sessions_by_kv(77) == 0
    assert Geometry((16,), (None,)).aged_blocks is None  # full attention grows with age
    assert Geometry((16, 16), (None, 64)).sessions_by_kv(10_000) is None
    assert Geometry((), ()).aged_blocks is None
    assert Geometry((16,), (32,)).aged_blocks == 3 and Geometry((16,), (33,)).aged_blocks == 4


def test_a_reanchor_drops_whole_head_blocks_and_shifts_everything_alike() -> None:
    dec, enc = voxtral()
    req = session(9000, managers=(dec, enc))
    enc_blocks_before = list(enc.req_to_blocks["r"])
    dec_blocks_before = list(dec.req_to_blocks["r"])
    cache = EncoderCache({"r": {len(req.mm_features) - 1}})  # the queued chunk's embeds
    shift = check(req, (dec, enc), geometry_of((dec, enc)))
    assert shift == (9000 - 8191) // 128 * 128 == 768
    r = apply(req, (dec, enc), cache, shift, seq=1)

    assert req.num_computed_tokens == 9000 - 768
    assert req._all_token_ids[0] == 768 and len(req._all_token_ids) == 9001 - 768
    assert req.prompt_token_ids == req._all_token_ids and req.num_prompt_tokens == 9001 - 768
    # Features wholly before 768 are gone; the rest moved down by 768, in order.
    assert req.mm_features[0].identifier == "f768"
    assert [f.mm_position.offset for f in req.mm_features[:3]] == [0, 1, 2]
    assert req.mm_features[-1].mm_position.offset == 9000 - 768
    # The queued chunk's cached embeddings keep pointing at the same feature.
    assert cache.request_cached_ids["r"] == {len(req.mm_features) - 1}
    assert cache.freed == []
    # Head blocks: 768/128 = 6 decoder blocks, 768/16 = 48 encoder blocks, all null.
    assert dec.req_to_blocks["r"] == dec_blocks_before[6:]
    assert enc.req_to_blocks["r"] == enc_blocks_before[48:]
    assert dec.num_cached_block["r"] == len(dec_blocks_before) - 6
    assert dec.block_pool.freed == [] and enc.block_pool.freed == []
    # The worker re-rotates exactly the live blocks, per group, after the shift.
    assert r.shift == 768 and r.seq == 1 and r.request_id == "r"
    assert r.block_ids[0] == tuple(b.block_id for b in dec.req_to_blocks["r"] if not b.is_null)
    assert r.block_ids[1] == tuple(b.block_id for b in enc.req_to_blocks["r"] if not b.is_null)


def test_every_position_a_query_can_see_stays_in_a_live_block() -> None:
    """A session run for 3 × max_model_len of chunks with re-anchoring whenever due:
    positions never reach max_model_len, and after each re-anchor every position in the
    next query's window of every group is in a live block."""
    max_model_len, every = 12288, 2048
    dec, enc = voxtral()
    managers = (dec, enc)
    g = geometry_of(managers)
    req = session(39, managers=managers)
    cache = EncoderCache()
    reanchors = 0
    absolute = 39  # positions the session has ever taken (no cap)
    for _ in range(3 * max_model_len):
        if due(req.num_computed_tokens, g, every):
            apply(req, managers, cache, check(req, managers, g), seq=reanchors)
            reanchors += 1
            n = req.num_computed_tokens
            for m in managers:
                assert m.sliding_window is not None
                first_seen = max(0, n - m.sliding_window + 1)
                blocks = m.req_to_blocks["r"]
                for p in range(first_seen, n):
                    assert not blocks[p // m.block_size].is_null, (m.block_size, p)
        # The chunk runs: one more position computed, then the next chunk is queued.
        req.num_computed_tokens += 1
        absolute += 1
        p = req.num_computed_tokens
        req._all_token_ids.append(p)
        req.prompt_token_ids.append(p)
        req.num_prompt_tokens += 1
        req.mm_features.append(chunk_feature(f"a{absolute}", p))
        for m in managers:
            blocks = m.req_to_blocks["r"]
            while len(blocks) * m.block_size < p + 1:
                blocks.append(Block(next(_ids)))
            assert m.sliding_window is not None
            skipped = max(0, p - m.sliding_window + 1) // m.block_size
            for i in range(skipped):
                blocks[i] = NULL
        assert len(req._all_token_ids) < max_model_len
    assert absolute > 3 * max_model_len and reanchors >= 10


def test_a_feature_is_never_cut() -> None:
    dec, enc = voxtral()
    req = session(9000, managers=(dec, enc))
    # One 500-position feature straddles the naive shift (768): stop at its start.
    req.mm_features = [chunk_feature(f"f{p}", p) for p in range(39, 640)]
    req.mm_features += [Feature("big", PlaceholderRange(640, 501)),
                        *[chunk_feature(f"f{p}", p) for p in range(1140, 9001)]]
    shift = check(req, (dec, enc), geometry_of((dec, enc)))
    assert shift == 640  # its start, a multiple of the 128-position unit
    apply(req, (dec, enc), EncoderCache(), shift, seq=1)
    assert req.mm_features[0].mm_position == PlaceholderRange(0, 501)


def test_a_straddler_whose_start_is_off_the_unit_is_backed_off_again() -> None:
    """Backing off to a straddling feature's start rounded down to the unit can land
    inside the feature before it: checked again until nothing is cut (the old code
    stopped after one back-off and left a kept feature at a negative offset)."""
    dec, enc = voxtral()
    req = session(9000, managers=(dec, enc))
    # Bulk features of 700 positions from 39: starts 39, 739, 1439…, none on the unit
    req.mm_features = [Feature("f0", PlaceholderRange(0, 39))]
    req.mm_features += [Feature(f"b{s}", PlaceholderRange(s, 701)) for s in range(39, 8439, 700)]
    req.mm_features += [chunk_feature(f"f{p}", p) for p in range(8439, 9001)]
    with pytest.raises(CannotReanchor, match="cut a feature"):
        check(req, (dec, enc), geometry_of((dec, enc)))
    assert req.num_computed_tokens == 9000  # left as it was


def test_two_position_placeholders_leave_no_feature_before_position_zero() -> None:
    """The bug this guards: with vLLM's 2-position chunk placeholders every position is
    inside some placeholder, and the old rule (never cut a placeholder) backed off once
    and kept the feature at D - 1, at offset -1 after the shift."""
    dec, enc = voxtral()
    managers = (dec, enc)
    req = session(9000, managers=managers)
    shift = check(req, managers, geometry_of(managers))
    assert shift == 768
    apply(req, managers, EncoderCache(), shift, seq=1)
    assert min(f.mm_position.offset for f in req.mm_features) == 0
    assert req.mm_features[0].identifier == "f768"


def gathered_rows(features: list[Feature], samples: list[int], start: int, end: int
                  ) -> list[int]:
    """For each position in [start, end): embedding rows vLLM 0.26's encoder runner
    (worker/gpu/mm/encoder_runner.py:gather_mm_embeddings) would take for it, from each
    overlapping feature's output of `embeddings_made` rows (a slice past the end is
    empty); it raises "Encoder cache miss" for a feature it needs that is not there."""
    rows = [0] * (end - start)
    for f, n in zip(features, samples, strict=True):
        a, length = f.mm_position.offset, f.mm_position.length
        lo, hi = max(start - a, 0), min(end - a, length)
        if lo >= hi:
            continue
        made = embeddings_made(n)
        for i in range(lo, min(hi, made)):
            rows[a + i - start] += 1
    return rows


def test_placeholders_after_reanchors_give_a_recompute_one_embedding_per_position() -> None:
    """After re-anchors, a preempted request is recomputed from 0: every position it
    holds must get exactly one embedding row from its kept features, none of which may
    start before 0 (vLLM's V2 runner then asks for an input nobody encoded)."""
    max_model_len, every = 12288, 2048
    dec, enc = voxtral()
    managers = (dec, enc)
    g = geometry_of(managers)
    req = session(39, managers=managers)
    samples = [FIRST_SAMPLES] + [CHUNK_SAMPLES] * (len(req.mm_features) - 1)
    reanchors = 0
    for _ in range(2 * max_model_len):
        if due(req.num_computed_tokens, g, every):
            before = len(req.mm_features)
            apply(req, managers, EncoderCache(), check(req, managers, g), seq=reanchors)
            samples = samples[before - len(req.mm_features):]
            reanchors += 1
            assert min(f.mm_position.offset for f in req.mm_features) >= 0
            n = req.num_computed_tokens
            assert gathered_rows(req.mm_features, samples, 0, n) == [1] * n
        req.num_computed_tokens += 1
        p = req.num_computed_tokens
        req._all_token_ids.append(p)
        req.prompt_token_ids.append(p)
        req.num_prompt_tokens += 1
        req.mm_features.append(chunk_feature(f"a{p}", p))
        samples.append(CHUNK_SAMPLES)
        for m in managers:
            blocks = m.req_to_blocks["r"]
            while len(blocks) * m.block_size < p + 1:
                blocks.append(Block(next(_ids)))
    assert reanchors >= 4


def test_embedded_spans_end_where_the_next_placeholder_begins() -> None:
    feats = [Feature("a", PlaceholderRange(0, 39)), chunk_feature("b", 39),
             chunk_feature("c", 40), Feature("d", PlaceholderRange(41, 769))]
    assert embedded_spans(feats) == [(0, 39), (39, 40), (40, 41), (41, 810)]


def test_cached_embeddings_of_dropped_features_are_freed_and_the_rest_renumbered() -> None:
    dec, enc = voxtral()
    req = session(9000, managers=(dec, enc))
    n_drop = sum(1 for f in req.mm_features if f.mm_position.offset < 768)
    cache = EncoderCache({"r": {0, 5, n_drop + 2}})
    apply(req, (dec, enc), cache, 768, seq=1)
    assert sorted(i for _, i in cache.freed) == [0, 5]
    assert cache.request_cached_ids["r"] == {2}


def test_stale_head_blocks_are_freed_not_leaked() -> None:
    dec, enc = voxtral()
    req = session(9000, managers=(dec, enc))
    stale = Block(999_999)
    dec.req_to_blocks["r"][0] = stale  # not yet freed to the null block
    apply(req, (dec, enc), EncoderCache(), 768, seq=1)
    assert dec.block_pool.freed == [999_999]


@pytest.mark.parametrize(("field_name", "value", "why"), [
    ("num_output_placeholders", 1, "in flight"),
    ("num_in_flight_tokens", 1, "in flight"),
    ("spec_token_ids", [5], "speculative"),
    ("block_hashes", [b"h"], "prefix caching"),
    ("prompt_embeds", object(), "embeddings"),
])
def test_a_request_that_is_not_at_a_clean_boundary_is_left_alone(
        field_name: str, value: object, why: str) -> None:
    dec, enc = voxtral()
    req = session(9000, managers=(dec, enc))
    setattr(req, field_name, value)
    with pytest.raises(CannotReanchor, match=why):
        check(req, (dec, enc), geometry_of((dec, enc)))
    assert req.num_computed_tokens == 9000 and len(req._all_token_ids) == 9001


def test_nothing_moves_while_every_position_is_in_a_window() -> None:
    dec, enc = voxtral()
    req = session(8300, managers=(dec, enc))
    with pytest.raises(CannotReanchor, match="window"):
        check(req, (dec, enc), geometry_of((dec, enc)))
    assert not due(8300, geometry_of((dec, enc)), 128)
    assert due(8191 + 4096, geometry_of((dec, enc)), 4096)
    assert not due(8191 + 4095, geometry_of((dec, enc)), 4096)


def test_output_tokens_mean_the_request_is_not_at_a_chunk_boundary() -> None:
    dec, enc = voxtral()
    req = session(9000, managers=(dec, enc))
    req._all_token_ids.append(7)  # a sampled token not yet folded into the prompt
    with pytest.raises(CannotReanchor, match="chunk boundary"):
        check(req, (dec, enc), geometry_of((dec, enc)))
