"""Named subsets of the report's rows (``--select NAME``), as data.

A selector is a dict of row labels (``target`` among them); a row is kept when every label of
some selector matches (``variant_has``: one word of the row's variant string).
``ci``: the variants of each kernel the full report shows heaviest on every target (most
registers, most shared memory: the ones that would spill or overflow first), compiled by
``tests/test_triton_compile.py``; the full report (all variants) is the command without
``--select``.
"""

from __future__ import annotations

SUBSETS: dict[str, list[dict]] = {
    # Heaviest in the full report of 2026-12-02 (bench/RESULTS.md): registers, per kernel and target.
    "ci": [
        {"kernel": "_cache_write_kernel", "dtype": "float32", "cache": "fp8_ds_mla"},  # 48 regs on sm_90/sm_100
        # the most registers on sm_100 (221), 16 heads
        {"kernel": "_decode_split_kernel", "dtype": "bfloat16", "cache": "native", "mask": "chunked_causal",
         "sparse": "logical"},
        # 32-head blocks, top-k lengths: 220 on sm_90
        {"kernel": "_decode_split_kernel", "dtype": "bfloat16", "cache": "fp8_e4m3", "sparse": "physical", "variant_has": "BLOCK_H=32"},
        # float32 dots, top-k lengths: 456 of gfx942's 512 VGPRs
        {"kernel": "_decode_split_kernel", "dtype": "float32", "cache": "native", "sparse": "physical", "target": "gfx942"},
        # 252 on sm_90
        {"kernel": "_decode_split_ds_mla_kernel", "dtype": "bfloat16", "sparse": "physical", "variant_has": "BLOCK_H=32"},
        # float32 dots on 8 waves: 255 of the 256 VGPRs an 8-wave work-group leaves a wave on gfx942
        {"kernel": "_decode_split_ds_mla_kernel", "dtype": "float32", "sparse": "physical", "target": "gfx942"},
        {"kernel": "_flare_prefill_kernel", "dtype": "bfloat16", "cache": "fp8_ds_mla"},  # 218 on sm_90, 250 on gfx942
        {"kernel": "_flare_prefill_kernel", "dtype": "float16", "cache": "fp8_ds_mla"},  # float32 dots (issue 25 item 3)
        {"kernel": "_merge_kernel", "dtype": "bfloat16", "cache": "native", "variant_has": "SINK_PER_SEQ=False"},
        # V4 shared-KV, 32-head blocks over top-k picks: 194 regs on sm_90, 242 VGPRs on gfx942 (2026-12-02)
        {"kernel": "_shared_kv_split_kernel", "dtype": "bfloat16", "compressed": "indices", "variant_has": "BLOCK_H=32"},
        # float32 dots: 348 VGPRs + 92 AGPRs on gfx942, no VGPR spills (sm_90: 212 regs)
        {"kernel": "_shared_kv_split_kernel", "dtype": "float32", "compressed": "indices", "target": "gfx942"},
    ],
}


def _match_one(row: dict, selector: dict) -> bool:
    for key, want in selector.items():
        if key == "variant_has":
            if want not in row.get("variant", "").split():
                return False
        elif row.get(key) != want:
            return False
    return True


def matches(row: dict, selectors: list[dict]) -> bool:
    return any(_match_one(row, s) for s in selectors)
