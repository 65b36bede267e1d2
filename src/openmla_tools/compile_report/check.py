"""What a report row must not show: a compile error, spills, or more shared memory (LDS) than
one block (work-group) of the target may have."""

from __future__ import annotations

from .targets import TARGETS


def _spills(row: dict, is_amd: bool) -> str | None:
    if is_amd:  # SGPR spills land in VGPR lanes; memory spills show as VGPR spills or scratch
        if row["vgpr_spills"] or row["scratch"]:
            return f"spills: {row['vgpr_spills']} VGPRs, {row['scratch']} scratch bytes per lane"
        return None
    if row["spill_stores"] or row["spill_loads"]:
        return f"spills: {row['spill_stores']} bytes stored, {row['spill_loads']} loaded"
    return None


def violations(row: dict) -> list[str]:
    """Why ``row`` fails (empty when it passes)."""
    if "error" in row:
        return [f"compile error: {row['error'][:300]}"]
    target = TARGETS[row["target"]]
    found = [_spills(row, target.is_amd)]
    if not target.limits.smem_ok(row["smem"]):
        found.append(f"shared memory {row['smem']} B over the {target.name} limit per block")
    return [f for f in found if f]


def failures(rows: list[dict]) -> list[str]:
    """One line per failing row."""
    out = []
    for row in rows:
        for why in violations(row):
            out.append(f"{row['target']} {row['kernel']} {row['dtype']} {row['cache']} {row['variant']}: {why}")
    return out
