"""One re-anchor of one streaming request, on vLLM's scheduler-side objects.

Plain code over duck-typed objects shaped like vLLM 0.26's (`Request`, the KV cache
group managers, the encoder cache manager), so the rules can be tested without vLLM.
`check()` decides (and changes nothing); `apply()` only does list and counter
updates that cannot fail half-way.

The rules:
- A request may move down by D positions at a chunk boundary: everything computed,
  nothing in flight (no output placeholders, no speculative tokens), the next chunk
  queued but not yet scheduled.
- D drops only positions that no layer can attend to any more: every KV cache group is
  a sliding window, and the next query (at the computed length n) sees positions
  > n − window, so D ≤ n − max(window − 1) over groups.
- D is a multiple of every group's block size, so whole head blocks go away and the
  block table of the shifted request still maps position p to block p // block_size.
- A multimodal feature (one audio chunk's embeddings) is dropped whole or kept whole:
  D never cuts one. vLLM 0.26 gives an 80 ms chunk (2,160 samples with its look-back and
  look-ahead) a placeholder of 2 positions (mistral_common's `num_audio_tokens`, which
  rounds up) while the encoder makes one embedding, and `_update_request_as_session`
  places each chunk's placeholder at the request's length: consecutive placeholders
  overlap by one position, and vLLM's gather takes an empty slice from the older one
  there. A feature's embeddings therefore cover its placeholder up to the next
  feature's offset (`embedded_spans`); that span is what D must not cut, and a feature
  whose span ends at or before D goes (its spare placeholder position included). A kept
  feature at a negative offset would make a recompute after preemption ask the encoder
  cache for an input it no longer has ("Encoder cache miss", which kills the engine core).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class CannotReanchor(Exception):
    """This request cannot move now (said why); it is left as it was."""


@dataclass(frozen=True, slots=True)
class Reanchor:
    """What the worker must do before the request runs again: re-rotate the keys of
    the live blocks (block ids per KV cache group, after the shift) by R(−shift)."""

    seq: int
    request_id: str
    shift: int
    block_ids: tuple[tuple[int, ...], ...]
    fault: str | None = None
    """NEGATIVE CONTROLS ONLY (the GPU tier's, through a request's extra args): rotate
    wrongly on purpose — "sign" (R(+D)), "block" (D less one KV block unit), "encoder_x1"
    (the encoder's keys by D, not 4·D), "garbage" (keys replaced by noise). None always in
    production."""


@dataclass(frozen=True, slots=True)
class Geometry:
    """The KV cache groups as the scheduler sees them."""

    block_sizes: tuple[int, ...]
    windows: tuple[int | None, ...]
    """Sliding window of each group in its own positions (None: full attention)."""

    @property
    def unit(self) -> int:
        """D is a multiple of this: every group's block size."""
        return math.lcm(*self.block_sizes)

    @property
    def keep(self) -> int:
        """Positions before the newest that some layer can still attend to."""
        if any(w is None for w in self.windows):
            raise CannotReanchor("a KV cache group has full attention")
        return max(w - 1 for w in self.windows if w is not None)

    @property
    def aged_blocks(self) -> int | None:
        """KV blocks a session holds once it is older than every window: each group's
        window in whole blocks, and the block being filled. None where a group has full
        attention (a session's blocks then grow with its age). The H200's KV trace agrees:
        65 decoder blocks (window 8,192, block 128) and 13 encoder blocks (189, 16)."""
        if not self.block_sizes or any(w is None for w in self.windows):
            return None
        pairs = zip(self.windows, self.block_sizes, strict=True)
        return sum(math.ceil(w / b) + 1 for w, b in pairs if w is not None)

    def sessions_by_kv(self, kv_blocks: int) -> int | None:
        """Sessions older than every window that `kv_blocks` blocks hold (None: unbounded
        by windows, see `aged_blocks`)."""
        per = self.aged_blocks
        return kv_blocks // per if per else None

    def why_not(self) -> str | None:
        if not self.block_sizes:
            return "no KV cache groups"
        if any(w is None for w in self.windows):
            return "a KV cache group has full attention (no sliding window)"
        return None


def geometry_of(managers: Sequence[Any]) -> Geometry:
    """From the coordinator's single-type managers (vLLM 0.26: `block_size`, and
    `sliding_window` on SlidingWindowManager only)."""
    return Geometry(tuple(int(m.block_size) for m in managers),
                    tuple(getattr(m, "sliding_window", None) for m in managers))


def due(num_computed: int, geometry: Geometry, every: int) -> bool:
    """Re-anchor once `every` positions could go: a re-anchor re-rotates each live key
    once (one bf16 rounding), so fewer, larger shifts keep keys closer to exact."""
    return num_computed - geometry.keep >= max(every, geometry.unit)


def embedded_spans(features: Sequence[Any]) -> list[tuple[int, int]]:
    """Each feature's (start, end) positions that its embeddings fill: its placeholder,
    cut at the next feature's offset where the two overlap (see the module docstring).
    Features are in offset order, as vLLM appends them."""
    spans: list[tuple[int, int]] = []
    for i, f in enumerate(features):
        start = int(f.mm_position.offset)
        end = start + int(f.mm_position.length)
        if i + 1 < len(features):
            end = min(end, max(start, int(features[i + 1].mm_position.offset)))
        spans.append((start, end))
    return spans


def choose_shift(request: Any, geometry: Geometry) -> int:
    """The largest allowed D for this request now (0: none): a multiple of the unit,
    out of every window, and cutting no feature's embeddings (if one straddles D, D
    backs off to that feature's start, rounded down to the unit, and is checked again)."""
    n = int(request.num_computed_tokens)
    unit = geometry.unit
    shift = (n - geometry.keep) // unit * unit
    spans = embedded_spans(request.mm_features)
    starts = [a for a, _ in spans]
    while shift > 0:
        i = bisect.bisect_left(starts, shift) - 1  # the last feature starting before D
        if i < 0 or spans[i][1] <= shift:
            break
        shift = spans[i][0] // unit * unit
    return max(shift, 0)


def check(request: Any, managers: Sequence[Any], geometry: Geometry) -> int:
    """D for this request, or CannotReanchor. Reads only."""
    if request.num_output_placeholders or getattr(request, "num_in_flight_tokens", 0):
        raise CannotReanchor("a step of this request is still in flight")
    if request.spec_token_ids:
        raise CannotReanchor("speculative tokens are pending")
    if request.block_hashes:
        raise CannotReanchor("prefix caching hashes blocks (turn prefix caching off)")
    if request.prompt_embeds is not None or getattr(request, "prompt_is_token_ids", None):
        raise CannotReanchor("prompt embeddings are not shifted")
    if request.prompt_token_ids is None or len(request.prompt_token_ids) != len(
            request._all_token_ids):
        raise CannotReanchor("the request has output tokens (not at a chunk boundary)")
    if request.num_computed_tokens > len(request._all_token_ids):
        raise CannotReanchor("computed tokens exceed the token history")
    shift = choose_shift(request, geometry)
    if shift <= 0:
        if (int(request.num_computed_tokens) - geometry.keep) // geometry.unit > 0:
            raise CannotReanchor("every shift out of the windows would cut a feature's "
                                 "embeddings")
        raise CannotReanchor("nothing is out of every window yet")
    rid = request.request_id
    for m in managers:
        blocks = m.req_to_blocks.get(rid, [])
        if len(blocks) * m.block_size < request.num_computed_tokens:
            raise CannotReanchor("the request's blocks do not cover its computed tokens")
    return shift


def apply(request: Any, managers: Sequence[Any], encoder_cache: Any, shift: int,
          seq: int, fault: str | None = None) -> Reanchor:
    """Lower the request's positions by `shift` (from `check`). Returns the worker's part."""
    rid = request.request_id
    # Features: drop those whose embeddings end at or before `shift` (`check` made sure
    # none is cut: those are exactly the ones starting before it), free any still cached
    # first (their cache entries are indexed by position in the list), move the rest down.
    n_drop = sum(1 for f in request.mm_features if f.mm_position.offset < shift)
    cached = encoder_cache.request_cached_ids.get(rid)
    if cached:
        for input_id in sorted(i for i in cached if i < n_drop):
            encoder_cache.free_encoder_input(request, input_id)
        cached = encoder_cache.request_cached_ids.get(rid)
        if cached:
            encoder_cache.request_cached_ids[rid] = {i - n_drop for i in cached}
    request.mm_features = [
        dataclasses.replace(f, mm_position=dataclasses.replace(
            f.mm_position, offset=f.mm_position.offset - shift))
        for f in request.mm_features[n_drop:]
    ]
    # Token history: in place, `all_token_ids` is a read-only view of this list.
    del request._all_token_ids[:shift]
    del request.prompt_token_ids[:shift]
    request.num_prompt_tokens = len(request.prompt_token_ids)
    request.num_computed_tokens -= shift
    # Head blocks: already outside every window (normally freed to the null block).
    live: list[tuple[int, ...]] = []
    for m in managers:
        blocks = m.req_to_blocks[rid]
        k = shift // m.block_size
        null = m._null_block
        stale = [b for b in blocks[:k] if b is not null and not getattr(b, "is_null", False)]
        if stale:
            m.block_pool.free_blocks(stale)
        del blocks[:k]
        if rid in m.num_cached_block:
            m.num_cached_block[rid] = max(0, m.num_cached_block[rid] - k)
        live.append(tuple(b.block_id for b in blocks
                          if b is not null and not getattr(b, "is_null", False)))
    return Reanchor(seq=seq, request_id=rid, shift=shift, block_ids=tuple(live), fault=fault)
