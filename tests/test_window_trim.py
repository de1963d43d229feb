"""Window-trimmed FlashAttention metadata (workers/engines/vllm/reanchor/window_trim.py).

FA3 and vLLM are not installed here (FA3 needs CUDA), so the trimming is checked against
`window_trim.reference`, a float32 paged sliding-window attention defined as FA3 defines
it; on the GPU, `switch` runs FA3 itself trimmed and untrimmed against that reference, and
tests/gpu/test_vllm_engine.py decodes with the lever on and off. The builder wrappers are
checked with `StandInBuilder`, which follows the parts of vLLM 0.26's
FlashAttentionMetadataBuilder that they touch (build, update_block_table) as read.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from workers.engines.vllm.reanchor import window_trim as wt

pytestmark = pytest.mark.unit


def paged_case(lens: list[int], q_len: int, block: int, heads: int = 4, kv_heads: int = 2,
               dim: int = 16, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    per = -(-max(lens) // block)
    n_blocks = len(lens) * per + 1
    table = (torch.randperm(n_blocks - 1, generator=g)[: len(lens) * per] + 1)
    return {"q": torch.randn(len(lens) * q_len, heads, dim, generator=g),
            "k": torch.randn(n_blocks, block, kv_heads, dim, generator=g),
            "v": torch.randn(n_blocks, block, kv_heads, dim, generator=g),
            "cu": torch.arange(0, len(lens) * q_len + 1, q_len, dtype=torch.int32),
            "seq": torch.tensor(lens, dtype=torch.int32),
            "table": table.view(len(lens), per).to(torch.int32)}


def attend(c: dict[str, Any], seq: torch.Tensor, table: torch.Tensor, left: int) -> torch.Tensor:
    return wt.reference(c["q"], c["k"], c["v"], c["cu"], seq, table, left, 0.25)


@pytest.mark.parametrize(("left", "block", "q_len"), [(299, 16, 1), (749, 64, 4), (63, 64, 4),
                                                     (8191, 128, 1)])
def test_trimmed_metadata_attends_to_the_same_keys(left: int, block: int, q_len: int) -> None:
    rng = random.Random(left)
    lens = [q_len, left, left + q_len, left + q_len + block - 1, left + q_len + block,
            *(rng.randrange(q_len, 3 * (left + block)) for _ in range(5))]
    c = paged_case(lens, q_len, block, seed=left)
    seq, table, first = wt.trim(c["seq"], c["cu"], c["table"], left, block)
    assert int(first.max()) >= 1  # some windows slid past whole blocks
    assert torch.equal(seq, c["seq"] - first * block)
    assert int(seq.max()) <= wt.max_len_bound(max(lens), q_len, left, block)
    full, cut = attend(c, c["seq"], c["table"], left), attend(c, seq, table, left)
    assert torch.allclose(full, cut, atol=1e-5, rtol=1e-5), (full - cut).abs().max()


def test_it_keeps_the_block_that_holds_the_first_visible_key_and_no_more() -> None:
    """Tight: dropping one block more than `trim` does changes what the first query sees."""
    left, block, q_len = 40, 8, 1
    lens = [left + q_len + 3 * block]  # the first visible key opens block 3 exactly
    c = paged_case(lens, q_len, block)
    seq, table, first = wt.trim(c["seq"], c["cu"], c["table"], left, block)
    assert first.tolist() == [3]
    assert torch.allclose(attend(c, c["seq"], c["table"], left), attend(c, seq, table, left),
                          atol=1e-5)
    over_seq = seq - block  # one block more
    over_table = wt.shift_table(c["table"], first + 1)
    assert not torch.allclose(attend(c, c["seq"], c["table"], left),
                              attend(c, over_seq, over_table, left), atol=1e-3)


def test_requests_within_their_window_are_left_as_they_are() -> None:
    c = paged_case([5, 40, 41], 1, 8)
    seq, table, first = wt.trim(c["seq"], c["cu"], c["table"], 40, 8)
    assert first.tolist() == [0, 0, 0]
    assert torch.equal(seq, c["seq"]) and torch.equal(table, c["table"])


# ---- the builder wrappers, on a stand-in builder -----------------------------------------
@dataclasses.dataclass
class Common:
    """The fields of vLLM 0.26's CommonAttentionMetadata that the wrapper reads or sets."""
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_table_tensor: torch.Tensor
    max_seq_len: int
    max_query_len: int
    mm_req_doc_ranges: Any = None


class StandInBuilder:
    """FlashAttentionMetadataBuilder's build (metadata from the common metadata, as read)
    and update_block_table (a copy with another table)."""

    def __init__(self, window: int | None, block: int, dcp: int = 1,
                 full_graphs: bool = False) -> None:
        self.kv_cache_spec = SimpleNamespace(block_size=block, sliding_window=window)
        self.dcp_world_size = dcp
        self.rswa_window = None
        self.use_full_cuda_graph = full_graphs

    def build(self, common_prefix_len: int, common_attn_metadata: Common,
              fast_build: bool = False) -> Any:
        cm = common_attn_metadata
        return SimpleNamespace(seq_lens=cm.seq_lens, block_table=cm.block_table_tensor,
                               max_seq_len=cm.max_seq_len, slot_mapping=None)

    def update_block_table(self, metadata: Any, blk_table: torch.Tensor,
                           slot_mapping: Any) -> Any:
        return SimpleNamespace(**{**vars(metadata), "block_table": blk_table,
                                  "slot_mapping": slot_mapping})


def common(lens: list[int], block: int) -> Common:
    c = paged_case(lens, 1, block)
    return Common(c["seq"], c["cu"], c["table"], max(lens), 1)


def test_the_build_wrapper_trims_sliding_window_groups_only() -> None:
    build = wt._trimming_build(StandInBuilder.build)
    cm = common([300, 20], 16)
    slid = build(StandInBuilder(window=100, block=16), 0, cm)
    assert slid.seq_lens.tolist() == [300 - 12 * 16, 20]  # (300 - 1 - 99) // 16 = 12
    assert torch.equal(slid.block_table[0, :7], cm.block_table_tensor[0, 12:19])
    assert slid.max_seq_len == 1 + 99 + 15  # not the untrimmed 300: no GPU sync needed
    assert getattr(slid, wt.TRIM_ATTR).tolist() == [12, 0]
    # full attention, a cascade prefix, decode context parallelism, full CUDA graphs:
    # vLLM's metadata
    for builder, prefix in ((StandInBuilder(window=None, block=16), 0),
                            (StandInBuilder(window=100, block=16), 32),
                            (StandInBuilder(window=100, block=16, dcp=2), 0),
                            (StandInBuilder(window=100, block=16, full_graphs=True), 0)):
        same = build(builder, prefix, cm)
        assert same.seq_lens is cm.seq_lens and not hasattr(same, wt.TRIM_ATTR)


def test_a_table_swapped_in_later_is_trimmed_like_the_first() -> None:
    """vLLM's V1 runner reuses one group's metadata for another group of the same spec
    through update_block_table: the other group's table must drop the same blocks."""
    builder = StandInBuilder(window=100, block=16)
    build = wt._trimming_build(StandInBuilder.build)
    update = wt._trimming_update(StandInBuilder.update_block_table)
    cm = common([300, 250], 16)
    meta = build(builder, 0, cm)
    other = cm.block_table_tensor + 1000
    swapped = update(builder, meta, other, "slots")
    assert torch.equal(swapped.block_table, wt.shift_table(other, getattr(meta, wt.TRIM_ATTR)))
    assert swapped.slot_mapping == "slots" and torch.equal(swapped.seq_lens, meta.seq_lens)
    plain = update(builder, SimpleNamespace(seq_lens=cm.seq_lens, block_table=None), other, 0)
    assert plain.block_table is other  # untrimmed metadata keeps vLLM's swap



# ---- the "keys" mode: FA3's leftpad_k ---------------------------------------------------
@pytest.mark.parametrize(("left", "block", "q_len"), [(299, 16, 1), (749, 64, 4), (63, 64, 4),
                                                     (8191, 128, 1), (40, 8, 1)])
def test_padded_keys_attend_to_what_the_window_sees(left: int, block: int, q_len: int) -> None:
    """Keys from the pad on, `max_seqlen_k` cut to the query plus the window: for one-token
    queries FA3 then drops the window (the reference does as FA3 does), and the keys left
    are exactly the window's."""
    rng = random.Random(left + 1)
    lens = [q_len, left, left + q_len, left + q_len + 1, left + q_len + block,
            *(rng.randrange(q_len, 3 * (left + block)) for _ in range(5))]
    c = paged_case(lens, q_len, block, seed=left)
    pad = wt.leftpad(c["seq"], c["cu"], left)
    assert pad.dtype == torch.int32 and int(pad.max()) > 0
    assert pad.tolist() == [max(0, s - q_len - left) for s in lens]
    bound = wt.keys_bound(max(lens), q_len, left)
    assert bound == min(max(lens), q_len + left)
    full = attend(c, c["seq"], c["table"], left)
    padded = wt.reference(c["q"], c["k"], c["v"], c["cu"], c["seq"], c["table"], left, 0.25,
                          pad=pad, max_seqlen_k=bound)
    assert torch.allclose(full, padded, atol=1e-5, rtol=1e-5), (full - padded).abs().max()


def test_with_the_window_dropped_one_key_fewer_of_pad_changes_the_answer() -> None:
    """Tight, and the reason the pad must be exact: a one-token query whose window FA3
    drops attends to every key from the pad on, so a pad one key short adds a key."""
    left, block = 40, 8
    c = paged_case([left + 1 + 19], 1, block)  # the window starts inside a block
    pad = wt.leftpad(c["seq"], c["cu"], left)
    assert pad.tolist() == [19]
    bound = wt.keys_bound(int(c["seq"].max()), 1, left)
    full = attend(c, c["seq"], c["table"], left)
    short = wt.reference(c["q"], c["k"], c["v"], c["cu"], c["seq"], c["table"], left, 0.25,
                         pad=pad - 1, max_seqlen_k=bound)
    assert not torch.allclose(full, short, atol=1e-3)


def test_the_keys_build_hands_a_padded_view_of_seq_lens_to_window_groups_only() -> None:
    build = wt._padding_build(StandInBuilder.build)
    cm = common([300, 20], 16)
    slid = build(StandInBuilder(window=100, block=16), 0, cm)
    assert getattr(slid.seq_lens, wt.PAD_ATTR).tolist() == [300 - 1 - 99, 0]
    assert torch.equal(slid.seq_lens, cm.seq_lens)  # same lengths, same table, same bound
    assert torch.equal(slid.block_table, cm.block_table_tensor)
    assert slid.max_seq_len == 300
    assert not hasattr(cm.seq_lens, wt.PAD_ATTR)  # the shared tensor is left alone
    for builder, prefix in ((StandInBuilder(window=None, block=16), 0),
                            (StandInBuilder(window=100, block=16), 32),
                            (StandInBuilder(window=100, block=16, full_graphs=True), 0)):
        assert not hasattr(build(builder, prefix, cm).seq_lens, wt.PAD_ATTR)


def test_the_varlen_wrapper_pads_only_calls_whose_lengths_carry_a_pad(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TEST DOUBLES: `vllms` stands for vLLM's flash_attn_varlen_func and `op` for
    fa3_leftpad (FA3's op needs CUDA); the test checks which call goes where."""
    seen: dict[str, Any] = {}

    def vllms(**kwargs: Any) -> str:
        seen["vllm"] = kwargs
        return "vllm"

    def op(*args: Any) -> str:
        seen["op"] = args
        return "padded"

    monkeypatch.setattr(wt, "fa3_leftpad", op)
    wrapped = wt._padding_varlen(vllms)
    seq = torch.tensor([300, 20], dtype=torch.int32)
    call = {"q": "q", "k": "k", "v": "v", "out": "out", "cu_seqlens_q": "cu",
            "max_seqlen_q": 1, "max_seqlen_k": 300, "softmax_scale": 0.1, "causal": True,
            "window_size": [99, 0], "block_table": "table", "fa_version": 3,
            "alibi_slopes": None, "dynamic_causal": None, "num_splits": 0, "s_aux": None}
    before = dict(wt.CALLS)
    assert wrapped(**call, seqused_k=seq) == "vllm"
    padded = seq.view(-1)
    setattr(padded, wt.PAD_ATTR, torch.tensor([200, 0], dtype=torch.int32))
    assert wrapped(**call, seqused_k=padded) == "padded"
    args = seen["op"]
    assert args[6] is padded and args[7] == 300 and args[12] is getattr(padded, wt.PAD_ATTR)
    assert wt.CALLS["keys"] == before["keys"] + 1 and wt.CALLS["vllm"] == before["vllm"] + 1
    with pytest.raises(RuntimeError, match="alibi_slopes"):  # never silently unpadded
        wrapped(**{**call, "alibi_slopes": torch.ones(2)}, seqused_k=padded)
    with pytest.raises(RuntimeError, match="fa_version 2"):
        wrapped(**{**call, "fa_version": 2}, seqused_k=padded)
