"""The planner of scaled dot-product attention, tested on its own.

``_core._testing.plan_sdpa(call, query_tile, vector_width, threads)`` returns the plan the
driver would run for a described call, without running it: its path, how its work is cut
into tasks, and the scratch they need. The expectations here follow from the planner's rules
(see csrc/attention/sdpa_plan.cpp and the constants it reads), not from recorded plans:

- the tile path takes calls without weights with more than a quarter of a tile of queries per
  head; the rest, and the weights, take the row paths;
- the weights take the weights tile from a quarter of a tile of queries, where a tile's scores
  fit; else the rows with weights;
- the row path without weights groups the query heads that share a key head, and cuts the
  keys read into chunks that depend on the shape only, never on the thread count;
- query tiles share a task only on the tile path, where the keys span several chunks and
  outgrow L2, within the group bounds;
- the first tile of a task asks for its keys ahead only where the call reads more than a
  bound of keys and values; a head's values are copied onto cache lines only where they miss
  them, on the tile path, with tiles enough.
"""

from __future__ import annotations

import math

import hypothesis
import hypothesis.strategies as st
import pytest

from attnx import _core

testing = _core._testing
C = {name: int(value) for name, value in testing.planner_constants().items()}  # all whole numbers

# Kernel facts of the kernels attnx has: (query_tile, vector_width).
FACTS = [(16, 8), (16, 4), (32, 16), (16, 16), (8, 8)]


def plan(call, facts=(16, 8), threads=1):
    return testing.plan_sdpa(call, facts[0], facts[1], threads)


def call_of(B=1, Hq=1, Hk=None, L=1, S=1, E=64, Ev=None, **flags):
    call = dict(B=B, Hq=Hq, Hk=Hq if Hk is None else Hk, L=L, S=S, E=E, Ev=E if Ev is None else Ev)
    call.update(flags)
    return call


def ceil_div(a, b):
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("facts", FACTS)
def test_tile_path_from_more_than_a_quarter_of_a_tile_of_queries(facts):
    qt = facts[0]
    quarter = qt // 4
    for L in range(1, 2 * qt):
        expected = "tiles" if L * 4 > qt else "rows"
        assert plan(call_of(L=L, S=300), facts)["path"] == expected, L
    # The threshold itself: a quarter of a tile exactly is the row path, one more query tiles.
    assert plan(call_of(L=quarter, S=300), facts)["path"] == "rows"
    assert plan(call_of(L=quarter + 1, S=300), facts)["path"] == "tiles"


@pytest.mark.parametrize("facts", FACTS)
@pytest.mark.parametrize("element_size", [4, 8])
def test_weights_take_the_weights_tile_from_a_quarter_of_a_tile_where_it_fits(facts, element_size):
    qt = facts[0]
    for L in range(1, 2 * qt):
        expected = "weights_tile" if L * 4 >= qt else "rows_with_weights"
        got = plan(call_of(L=L, S=300, weights=True, element_size=element_size), facts)["path"]
        assert got == expected, L
    # A tile's scores (S x query_tile elements) must fit the bound.
    S_fit = C["weights_tile_bytes"] // (qt * element_size)
    L = qt
    assert plan(call_of(L=L, S=S_fit, weights=True, element_size=element_size), facts)["path"] == "weights_tile"
    assert plan(call_of(L=L, S=S_fit + 1, weights=True, element_size=element_size), facts)["path"] == (
        "rows_with_weights"
    )


def test_weights_never_take_the_paths_without_weights():
    for L in (1, 3, 4, 5, 16, 300):
        for S in (1, 100, 5000):
            assert plan(call_of(L=L, S=S, weights=True))["path"] in ("weights_tile", "rows_with_weights")


# ---------------------------------------------------------------------------------------------
# Rows, grouped heads and key chunks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Hq,Hk", [(1, 1), (8, 8), (8, 2), (8, 1), (12, 3)])
@pytest.mark.parametrize("L", [1, 2, 3, 4])
def test_row_path_groups_the_query_heads_of_a_key_head(Hq, Hk, L):
    p = plan(call_of(B=2, Hq=Hq, Hk=Hk, L=L, S=200))
    assert p["path"] == "rows"
    rows = (Hq // Hk) * L
    assert p["heads"] == Hk
    assert p["rows_per_head"] == rows
    assert p["rows_per_task"] == C["query_block"]
    assert p["q_blocks"] == ceil_div(rows, C["query_block"])
    assert p["tasks"] == 2 * Hk * p["q_blocks"] * p["chunks"]


def test_grouped_rows_past_a_block_take_several_tasks():
    qb = C["query_block"]
    # 4 query heads per key head, 3 rows each: 12 rows, one block; 16 heads x 3 rows: 48 rows.
    assert plan(call_of(Hq=4, Hk=1, L=3, S=64))["q_blocks"] == 1
    assert plan(call_of(Hq=16, Hk=1, L=3, S=64))["q_blocks"] == ceil_div(48, qb)


@pytest.mark.parametrize("Hq,Hk", [(8, 2), (4, 4)])
def test_paths_with_tiles_or_weights_take_every_query_head(Hq, Hk):
    tiles = plan(call_of(Hq=Hq, Hk=Hk, L=64, S=200))
    assert tiles["path"] == "tiles" and tiles["heads"] == Hq and tiles["rows_per_head"] == 64
    assert tiles["rows_per_task"] == 16 and tiles["q_blocks"] == 4
    weights = plan(call_of(Hq=Hq, Hk=Hk, L=2, S=200, weights=True))
    assert weights["path"] == "rows_with_weights" and weights["heads"] == Hq
    assert weights["rows_per_head"] == 2 and weights["rows_per_task"] == C["query_block"]


@pytest.mark.parametrize("S", [1, 100, 511, 512, 513, 1024, 1025, 3000, 100_000])
def test_decoding_cuts_the_keys_read_into_chunks(S):
    chunk = C["key_chunk"]
    p = plan(call_of(Hq=8, Hk=2, L=1, S=S))
    assert p["path"] == "rows"
    assert p["chunks"] == max(1, ceil_div(S, chunk))
    assert (p["chunks"] > 1) == (S > chunk)


# With int8 products a chunk is a quarter of the keys, in whole blocks, from key_chunk to four
# times that: (keys read, chunks).
@pytest.mark.parametrize("S, chunks", [(1, 1), (512, 1), (513, 2), (1000, 2), (2048, 4), (2049, 4),
                                       (3000, 4), (8192, 4), (8193, 5), (20_000, 10)])
def test_int8_products_cut_the_keys_into_chunks_of_a_quarter(S, chunks):
    p = plan(call_of(Hq=32, Hk=8, L=1, S=S, E=128, int8_products=True))
    assert p["path"] == "rows" and p["chunks"] == chunks
    assert plan(call_of(Hq=32, Hk=8, L=1, S=S, E=128))["chunks"] == max(1, ceil_div(S, C["key_chunk"]))


def test_chunks_follow_the_keys_read_not_the_stored_keys():
    chunk = C["key_chunk"]
    p = plan(call_of(L=1, S=4096, S_read=600, key_lengths=True))
    assert p["S_read"] == 600 and p["chunks"] == ceil_div(600, chunk)
    assert plan(call_of(L=1, S=4096, S_read=0, key_lengths=True))["chunks"] == 1


@hypothesis.settings(max_examples=200, deadline=None, derandomize=True, database=None)
@hypothesis.given(
    B=st.integers(1, 4),
    Hk=st.integers(1, 4),
    group=st.integers(1, 4),
    L=st.integers(1, 300),
    S=st.integers(0, 20_000),
    E=st.sampled_from([8, 16, 64, 80, 128, 256]),
    weights=st.booleans(),
    masks=st.booleans(),
    facts=st.sampled_from(FACTS),
    element_size=st.sampled_from([4, 8]),
)
def test_chunks_and_path_depend_on_the_shape_never_on_the_thread_count(
    B, Hk, group, L, S, E, weights, masks, facts, element_size
):
    call = call_of(B=B, Hq=Hk * group, Hk=Hk, L=L, S=S, E=E, weights=weights, masks=masks,
                   element_size=element_size)
    plans = [plan(call, facts, threads) for threads in (1, 2, 3, 8, 64)]
    for p in plans:
        assert p["threads"] in (1, 2, 3, 8, 64)
        # What sets the bits: the path, the key blocks and the chunks.
        for key in ("path", "chunks", "key_block", "heads", "rows_per_head", "rows_per_task", "q_blocks"):
            assert p[key] == plans[0][key], key
    p = plans[0]
    if p["path"] != "rows":
        assert p["chunks"] == 1 and p["states_size"] == 0
    else:
        assert p["chunks"] == max(1, ceil_div(S, C["key_chunk"]))
    # The tasks cover every (b, head, block of rows, chunk) once.
    for p in plans:
        assert p["q_groups"] == ceil_div(p["q_blocks"], p["group"])
        assert p["tasks"] == B * p["heads"] * p["q_groups"] * p["chunks"]
        assert p["scratch_per_thread"] > 0
        assert 1 <= p["group"] <= min(C["max_tile_group"], p["q_blocks"])


def test_chunk_states_are_kept_only_with_several_chunks():
    one = plan(call_of(B=2, Hq=4, Hk=2, L=1, S=512, Ev=40))
    assert one["chunks"] == 1 and one["states_size"] == 0
    several = plan(call_of(B=2, Hq=4, Hk=2, L=3, S=2000, Ev=40))
    assert several["chunks"] == 4
    assert several["state_size"] == 40 + 3  # m, l, open and the accumulator
    assert several["states_size"] == 2 * 4 * 3 * 4 * (40 + 3)


# ---------------------------------------------------------------------------------------------
# Key blocks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("facts", FACTS)
@pytest.mark.parametrize("element_size", [4, 8])
@pytest.mark.parametrize("E,Ev", [(8, 8), (16, 16), (32, 64), (64, 64), (80, 80), (128, 128), (256, 256)])
@pytest.mark.parametrize("skips", [None, "masks", "banded", "key_lengths", "query_lengths"])
def test_key_block_rule(facts, element_size, E, Ev, skips):
    qt = facts[0]
    flags = {skips: True} if skips else {}
    p = plan(call_of(L=64, S=1000, E=E, Ev=Ev, element_size=element_size, **flags), facts)
    keys = (48 * 1024) // ((E + Ev + qt) * element_size) // 16 * 16
    lowest = 64 if skips else 128
    assert p["key_block"] == min(max(keys, lowest), 256)
    assert p["key_block"] % 16 == 0 and lowest <= p["key_block"] <= 256


def test_key_block_is_the_same_for_every_way_of_skipping_blocks():
    # One rule for a mask written out, broadcast or given as is_causal: the same bits.
    blocks = {plan(call_of(L=64, S=1000, E=128, **{flag: True}))["key_block"]
              for flag in ("masks", "banded", "key_lengths", "query_lengths")}
    assert len(blocks) == 1


# ---------------------------------------------------------------------------------------------
# Tile groups
# ---------------------------------------------------------------------------------------------


def _flash_buffer_bytes(qt, E, Ev, element_size):
    return (E * qt + 2 * qt * Ev + 3 * qt) * element_size


def _expected_group(B, Hq, L, S, E, Ev, qt, element_size, threads):
    q_blocks = ceil_div(L, qt)
    if not (S > C["tile_chunk"] and S * (E + Ev) * element_size > C["tile_group_min_key_bytes"]):
        return 1
    group = min(max(C["tile_group_bytes"] // _flash_buffer_bytes(qt, E, Ev, element_size), 1),
                C["max_tile_group"])
    return min(group, q_blocks, max(1, B * Hq * q_blocks // (4 * threads)))


@pytest.mark.parametrize("threads", [1, 2, 4, 16])
@pytest.mark.parametrize(
    "B,H,L,S,E",
    [(1, 1, 512, 4096, 64), (1, 12, 1024, 4096, 64), (2, 2, 300, 2048, 128), (1, 1, 64, 1024, 512),
     (1, 1, 64, 1025, 512), (1, 8, 2048, 1500, 32)],
)
def test_tile_group_rule(threads, B, H, L, S, E):
    p = plan(call_of(B=B, Hq=H, L=L, S=S, E=E), (16, 8), threads)
    assert p["path"] == "tiles"
    assert p["group"] == _expected_group(B, H, L, S, E, E, 16, 4, threads)


def test_tiles_are_grouped_only_past_a_chunk_of_keys_that_outgrows_l2():
    # Keys within one chunk: never grouped, however large a head.
    assert plan(call_of(L=512, S=C["tile_chunk"], E=1024))["group"] == 1
    # Several chunks, but a head's keys and values within the bound: not grouped.
    S = C["tile_chunk"] + 16
    E = int(C["tile_group_min_key_bytes"] // (2 * 4 * S))  # E + Ev = 2E elements of 4 bytes
    assert S * 2 * E * 4 <= C["tile_group_min_key_bytes"]
    assert plan(call_of(L=512, S=S, E=E))["group"] == 1
    # Past it: grouped.
    assert plan(call_of(L=512, S=S, E=E + 16))["group"] > 1


def test_tile_groups_leave_tasks_enough_for_the_threads():
    call = call_of(B=1, Hq=2, L=1024, S=8192, E=64)
    threads = (1, 2, 4, 8, 16, 64)
    plans = [plan(call, (16, 8), t) for t in threads]
    groups = [p["group"] for p in plans]
    assert groups == sorted(groups, reverse=True)  # fewer tiles per task with more threads
    assert groups[0] > 1 and groups[-1] == 1
    for t, p in zip(threads, plans):
        # Grouped, the tasks still number four per thread or more.
        assert p["group"] == 1 or p["tasks"] >= 4 * t


def test_only_the_tile_path_groups_tiles():
    for call in (call_of(L=2, S=100_000), call_of(L=64, S=8000, weights=True), call_of(L=1, S=100_000, weights=True)):
        assert plan(call, (16, 8), 1)["group"] == 1


# ---------------------------------------------------------------------------------------------
# Keys asked ahead, values on cache lines
# ---------------------------------------------------------------------------------------------


def _call_bytes(call):
    es = call.get("element_size", 4)
    S = call.get("S_read", call["S"])

    def part(prefix, cols):
        element = 2 if call.get(prefix + "_16bit") else es
        heads = (1 if call.get(prefix + "_batch_broadcast") else call["B"]) * (
            1 if call.get(prefix + "_head_broadcast") else call["Hk"])
        return heads * S * cols * element

    return part("keys", call["E"]) + part("values", call["Ev"])


def test_keys_are_asked_ahead_only_past_the_call_bound():
    bound = C["ahead_min_call_bytes"]
    # B1 H8 D64: 512 bytes a key per head; the keys where the call's bytes pass the bound.
    S = bound // (8 * 128 * 4)
    below = call_of(Hq=8, L=16, S=S)
    above = call_of(Hq=8, L=16, S=S + 1)
    assert _call_bytes(below) == bound and _call_bytes(above) > bound
    assert not plan(below)["ask_ahead"]
    assert plan(above)["ask_ahead"]
    # Not on the row paths.
    assert not plan(call_of(Hq=8, L=1, S=S + 1))["ask_ahead"]
    assert not plan(call_of(Hq=8, L=16, S=S + 1, weights=True))["ask_ahead"]


@pytest.mark.parametrize(
    "flags",
    [dict(keys_batch_broadcast=True, values_batch_broadcast=True),
     dict(keys_head_broadcast=True, values_head_broadcast=True),
     dict(keys_16bit=True, values_16bit=True)],
)
def test_keys_asked_ahead_count_the_bytes_in_memory(flags):
    # Broadcast keys and values are read again, not from memory; 16-bit ones are half the bytes.
    S = C["ahead_min_call_bytes"] // (8 * 128 * 4) + 16
    call = call_of(B=2, Hq=4, L=16, S=S)
    assert plan(call)["ask_ahead"]
    call.update(flags)
    assert _call_bytes(call) <= C["ahead_min_call_bytes"]
    assert not plan(call)["ask_ahead"]


def test_grouped_tiles_ask_ahead_only_where_a_head_outgrows_l2():
    # Several tiles per task (q_groups > 1 with a group of one tile each would re-read a head
    # from L2): asked ahead only where the head's keys and values pass the group bound.
    S = 600
    call = call_of(B=1, Hq=400, L=64, S=S, E=64)
    assert _call_bytes(call) > C["ahead_min_call_bytes"]
    p = plan(call)
    assert p["q_groups"] > 1 and S * 128 * 4 <= C["tile_group_min_key_bytes"]
    assert not p["ask_ahead"]
    call = call_of(B=1, Hq=16, L=320, S=40_000, E=64)
    p = plan(call)
    assert p["group"] == C["max_tile_group"] and p["q_groups"] > 1 and p["ask_ahead"]


@pytest.mark.parametrize("facts,element_size,fewest", [((16, 8), 4, 4), ((16, 4), 8, 4), ((32, 16), 4, 5), ((16, 8), 8, 5)])
def test_values_are_copied_onto_lines_with_tiles_enough(facts, element_size, fewest):
    qt = facts[0]
    base = dict(S=300, E=64, values_on_lines=False, element_size=element_size)
    assert not plan(call_of(L=(fewest - 1) * qt, **base), facts)["align_values"]
    p = plan(call_of(L=fewest * qt, **base), facts)
    assert p["align_values"]
    line = 64 // element_size
    assert p["values_ld"] == ceil_div(64, line) * line
    assert p["values_copy_size"] == 300 * p["values_ld"] + line
    # Only where the rows miss the lines, and the values are stored natively.
    assert not plan(call_of(L=fewest * qt, **{**base, "values_on_lines": True}), facts)["align_values"]
    if element_size == 4:
        assert not plan(call_of(L=fewest * qt, values_16bit=True, **base), facts)["align_values"]
    # Nor for packed sequences: a batch's rows past its keys are another's, never copied.
    packed = dict(base, key_lengths=True, query_lengths=True, packed=True)
    assert not plan(call_of(L=fewest * qt, **packed), facts)["align_values"]


@pytest.mark.parametrize("facts", FACTS)
def test_bfloat16_products_plan_for_what_the_tile_path_reads(facts):
    # Pairs: bfloat16 keys and value pairs, never an aligned copy of the values. float32
    # products: float32 copies of the rounded rows, whose rows start on lines where whole lines
    # hold them (Ev 64), and miss them otherwise (Ev 72: then copied onto lines, as float32 rows
    # are), whatever the call stores.
    qt = facts[0]
    base = dict(L=8 * qt, S=300, E=64, values_on_lines=False, bf16_products=True)
    assert not testing.plan_sdpa(call_of(**base), *facts, 1, bf16_pairs=True)["align_values"]
    assert not testing.plan_sdpa(call_of(**base), *facts, 1, bf16_pairs=False)["align_values"]
    odd = dict(base, Ev=72, values_on_lines=True, values_16bit=True)
    assert testing.plan_sdpa(call_of(**odd), *facts, 1, bf16_pairs=False)["align_values"]
    assert not testing.plan_sdpa(call_of(**odd), *facts, 1, bf16_pairs=True)["align_values"]
    # The same call at the default precision: its own rows, on lines and 16-bit, are read.
    assert not plan(call_of(**dict(odd, bf16_products=False)), facts)["align_values"]


def test_values_copy_bounds():
    line = 16
    ld = ceil_div(80, line) * line  # Ev 80 -> 96 elements a row
    per_head = C["aligned_values_max_bytes"] // (ld * 4)
    base = dict(L=128, E=80, values_on_lines=False)
    assert plan(call_of(S=per_head, **base))["align_values"]
    assert not plan(call_of(S=per_head + 1, **base))["align_values"]
    # The copies of every thread within the call's bound.
    S = per_head // 2
    threads_fit = int(C["aligned_values_max_call_bytes"] // (S * ld * 4))
    assert plan(call_of(S=S, **base), (16, 8), threads_fit)["align_values"]
    assert not plan(call_of(S=S, **base), (16, 8), threads_fit + 1)["align_values"]


def test_values_asked_ahead_are_not_copied():
    S = C["ahead_min_call_bytes"] // (8 * 128 * 4) + 16
    p = plan(call_of(Hq=8, L=128, S=S, values_on_lines=False))
    assert p["ask_ahead"] and not p["align_values"] and p["values_copy_size"] == 0


# ---------------------------------------------------------------------------------------------
# Mask maps, value checks and scratch
# ---------------------------------------------------------------------------------------------


def test_masks_build_the_block_map_on_the_tile_paths_only():
    assert plan(call_of(L=64, S=300, masks=True))["mask_blocks"]
    assert plan(call_of(L=64, S=300, masks=True, weights=True))["mask_blocks"]
    assert not plan(call_of(L=1, S=300, masks=True))["mask_blocks"]
    assert not plan(call_of(L=1, S=300, masks=True, weights=True))["mask_blocks"]
    assert not plan(call_of(L=64, S=300, banded=True))["mask_blocks"]


def test_finite_values_are_taken_once_for_masked_tiles_of_native_values():
    assert plan(call_of(L=64, S=300, masks=True))["finite_values"]
    assert not plan(call_of(L=64, S=300, masks=True, values_16bit=True))["finite_values"]
    assert not plan(call_of(L=64, S=300, masks=True, weights=True))["finite_values"]
    assert not plan(call_of(L=64, S=300))["finite_values"]


@pytest.mark.parametrize("facts", FACTS)
@pytest.mark.parametrize("element_size", [4, 8])
def test_scratch_sizes_cover_each_path(facts, element_size):
    qt, W = facts
    E, Ev, S = 64, 40, 700
    kw = dict(E=E, Ev=Ev, S=S, element_size=element_size)
    tiles = plan(call_of(L=4 * qt, **kw), facts)
    kb = tiles["key_block"]
    per_tile = E * qt + 2 * qt * Ev + 3 * qt
    # A spare row before the score tile (bfloat16 products' pairs of keys), the tile itself, ...
    visit = qt + kb * qt + 2 * qt + kb + kb * (E + Ev) + 2 * kb * qt
    assert tiles["scratch_per_thread"] == tiles["group"] * per_tile + visit
    weights = plan(call_of(L=qt, weights=True, **kw), facts)
    assert weights["path"] == "weights_tile"
    S_lanes = ceil_div(S, W) * W
    assert weights["scratch_per_thread"] == (
        E * qt + (S + kb) * qt + qt * Ev + kb * (E + Ev) + 2 * kb * qt + qt * S_lanes)
    rows_w = plan(call_of(L=1, weights=True, **kw), facts)
    assert rows_w["scratch_per_thread"] == C["row_key_block"] * (E + Ev)
    rows = plan(call_of(L=1, **kw), facts)
    qb, kb_rows = C["query_block"], C["row_key_block"]
    assert rows["scratch_per_thread"] == qb * (kb_rows + Ev + 2) + kb_rows * (E + Ev)


def test_tile_groups_take_a_tile_of_buffers_each():
    call = call_of(B=1, Hq=1, L=1024, S=8192, E=64)
    one = plan(call, (16, 8), 64)
    many = plan(call, (16, 8), 1)
    assert one["group"] == 1 and many["group"] > 1
    per_tile = 64 * 16 + 2 * 16 * 64 + 3 * 16
    assert many["scratch_per_thread"] - one["scratch_per_thread"] == (many["group"] - 1) * per_tile


# ---------------------------------------------------------------------------------------------
# Threads, kernels and checks of the hook
# ---------------------------------------------------------------------------------------------


def test_work_counts_the_multiply_adds_and_the_keys_read():
    call = call_of(B=2, Hq=8, Hk=2, L=3, S=1000, E=64, Ev=32, S_read=700)
    madds = 2 * 8 * 3 * 700 * 96
    streamed = 2 * 2 * 700 * 96
    assert math.isclose(testing.sdpa_work(call), madds + 8 * streamed)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_active_kernels_facts_fit_the_planner(dtype):
    facts = testing.kernel_facts(dtype)
    qt, W = facts["query_tile"], facts["vector_width"]
    assert qt % W == 0 and 1 <= qt <= 64
    p = plan(call_of(L=qt, S=100), (qt, W))
    assert p["path"] == "tiles" and p["rows_per_task"] == qt


def test_the_hook_checks_its_call():
    with pytest.raises(KeyError):
        plan({"B": 1})
    with pytest.raises(KeyError):
        plan(call_of(L=4, bogus=True))
    with pytest.raises(ValueError):
        plan(call_of(Hq=3, Hk=2))
    with pytest.raises(ValueError):
        plan(call_of(S=10, S_read=11))
    with pytest.raises(ValueError):
        plan(call_of(element_size=2))
    with pytest.raises(ValueError):
        plan(call_of(), (12, 8))
    with pytest.raises(ValueError):
        plan(call_of(), (16, 8), 0)
