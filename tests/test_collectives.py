"""The collective-bytes reader of compiled HLO text (`gsm_jax.collectives`)."""
# ruff: noqa: E501  (HLO lines are long)

from __future__ import annotations

import pytest

from gsm_jax.collectives import collective_summary, collectives

HLO = """
HloModule jit_step, entry_computation_layout={...}

%region_0.1 (a: f32[], b: f32[]) -> f32[] {
  ROOT %add = f32[] add(f32[] %a, f32[] %b)
}

%body.2 (p: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %x = f32[8,64]{1,0} get-tuple-element(%p), index=1
  %all-reduce.9 = f32[8,64]{1,0} all-reduce(f32[8,64]{1,0} %x), channel_id=9, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%region_0.1, metadata={op_name="jit(step)/layer_0/attn/dot_general"}
  ROOT %t = (s32[], f32[8,64]) tuple(%i, %all-reduce.9)
}

ENTRY %main.3 (w: bf16[16,128]) -> f32[8,128] {
  %all-gather.1 = bf16[16,128]{1,0} all-gather(bf16[16,16]{1,0} %w), channel_id=1, replica_groups=[1,8]<=[8], dimensions={1}, metadata={op_name="jit(step)/lm_head/dot_general"}
  %all-reduce.2 = (f32[8,1,128]{2,1,0}, f32[8,128]{1,0}) all-reduce(%a, %b), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%region_0.1, metadata={op_name="jit(step)/layer_1/DecoderLayer.decode/moe/(shared_expert/dot_general:routed_experts/shard_map/psum)"}
  %all-to-all.3 = f32[8,4,64]{2,1,0} all-to-all(%c), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %cp = f32[8,16]{1,0} collective-permute(%d), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %w.1 = (s32[], f32[8,64]) while(%init), condition=%cond.4, body=%body.2
  ROOT %r = f32[8,128] copy(%all-reduce.2)
}
"""


def test_bytes_groups_scopes_and_loops():
    ops = collectives(HLO, devices=8)
    assert [o["kind"] for o in ops] == ["all-reduce", "all-gather", "all-reduce", "all-to-all",
                                        "collective-permute"]
    loop, gather, merged, a2a, permute = ops
    assert loop["in_loop"] and not gather["in_loop"]
    assert loop["group"] == 4 and loop["sent_bytes"] == 2 * 8 * 64 * 4 * 3 / 4
    assert loop["scopes"] == {"attn": loop["sent_bytes"]}
    assert gather["group"] == 8 and gather["sent_bytes"] == 16 * 128 * 2 * 7 / 8
    # a combined all-reduce: each tuple element goes to its own scope
    half = 2 * 8 * 128 * 4 * 7 / 8
    assert merged["scopes"] == pytest.approx({"moe/shared_expert": half,
                                              "moe/routed_experts": half})
    assert a2a["sent_bytes"] == 8 * 4 * 64 * 4 * 7 / 8
    assert a2a["scopes"] == {"(no scope)": pytest.approx(a2a["sent_bytes"])}
    assert permute["group"] == 2 and permute["sent_bytes"] == 8 * 16 * 4
    s = collective_summary(HLO, devices=8)
    assert s["ops"] == 5 and s["in_loop_ops"] == 1
    assert s["bytes_per_device"] == pytest.approx(sum(o["sent_bytes"] for o in ops))
    assert s["count_by_kind"]["all-reduce"] == 2
    assert s["by_scope"]["lm_head"] == gather["sent_bytes"]


def test_a_program_without_collectives():
    assert collective_summary("ENTRY %m () -> f32[] {\n ROOT %c = f32[] constant(0)\n}",
                              devices=1)["bytes_per_device"] == 0
