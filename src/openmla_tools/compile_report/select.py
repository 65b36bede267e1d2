"""Named subsets of the report's rows (``--select NAME``).

``ci``, compiled by ``tests/test_triton_compile.py``, is chosen by rule (``Heaviest``), not by
hand, from the last full report (its committed summary, ``docs/triton_compile_report.json``):
for every kernel and target, and for each width of its ``tl.dot`` operands (float32 dots apart
from half-precision ones, so float32 variants are always in), the variant closest to spilling
(spilled bytes, then registers); for every kernel and target, a variant with the most shared
memory (LDS; one of those already chosen when it has as much). Every binary the summary does not
know (a new kernel, tile or launch: never measured) is compiled too.

Why measured and not estimated from the tiles: variants with equal tiles differ by what tiles
do not show (fp8 widening, an unaligned record stride, a mask's integer work, where the register
allocator settles): in the report of 2026-12-06 by up to 39 VGPRs (gfx942 prefill) and 18
(gfx942 float32 shared-KV, by compressed mode alone), more than between tile configs.

A subset may also be a list of selectors: dicts of row labels (``target`` among them); a row is
kept when every label of some selector matches (``variant_has``: one word of the row's variant
string).
"""

from __future__ import annotations

import json
from pathlib import Path

from .summary import register_pressure

SUMMARY = Path(__file__).resolve().parents[3] / "docs" / "triton_compile_report.json"


def dot_width(row: dict) -> int:
    """Bytes of a row's ``tl.dot`` operands (``DOT_T`` in its variant; 0: no dot)."""
    for word in row.get("variant", "").split():
        if word.startswith("DOT_T="):
            return 4 if word == "DOT_T=fp32" else 2
    return 0


class Heaviest:
    """The rule over a full report's rows (``summary``: the committed summary's ``rows``).

    ``choose(candidates)`` -> ``(target, id)`` of the chosen binaries, from every distinct
    binary's labels (``report.candidates``)."""

    name = "per kernel, target and dot width the variant closest to spilling; per kernel and target the most shared memory"

    def __init__(self, summary: list[dict] | None = None, path: Path = SUMMARY) -> None:
        self._rows, self.path = summary, path

    def rows(self) -> list[dict]:
        """The full report's rows (none when the summary is missing: then every binary is chosen)."""
        if self._rows is None:
            self._rows = json.loads(self.path.read_text())["rows"] if self.path.exists() else []
        return self._rows

    def heaviest(self) -> set[tuple[str, str]]:
        """``(target, id)`` of the measured rows the rule keeps."""
        by_width: dict[tuple, list[dict]] = {}
        by_kernel: dict[tuple, list[dict]] = {}
        for r in self.rows():
            by_width.setdefault((r["target"], r["kernel"], dot_width(r)), []).append(r)
            by_kernel.setdefault((r["target"], r["kernel"]), []).append(r)
        picks = {(r["target"], r["id"]) for r in
                 (max(group, key=lambda r: (register_pressure(r), r["id"])) for group in by_width.values())}
        for group in by_kernel.values():  # a row with the most shared memory, if none picked has it
            most = max(r.get("smem", 0) for r in group)
            if not any((r["target"], r["id"]) in picks and r.get("smem", 0) == most for r in group):
                best = max(group, key=lambda r: (r.get("smem", 0), r["id"]))
                picks.add((best["target"], best["id"]))
        return picks

    def choose(self, candidates: list[dict]) -> set[tuple[str, str]]:
        measured = {(r["target"], r["id"]) for r in self.rows()}
        new = {(c["target"], c["id"]) for c in candidates} - measured
        return self.heaviest() | new


SUBSETS: dict[str, Heaviest | list[dict]] = {"ci": Heaviest()}


def _match_one(row: dict, selector: dict) -> bool:
    for key, want in selector.items():
        if key == "variant_has":
            if want not in row.get("variant", "").split():
                return False
        elif row.get(key) != want:
            return False
    return True


def matches(row: dict, selectors: list[dict]) -> bool:
    """Whether ``row`` (its labels) is kept by one of the hand-written ``selectors`` (a rule, ``Heaviest``, is
    applied to a whole candidate list: ``Heaviest.choose``, as ``report.tasks_for`` does)."""
    return any(_match_one(row, s) for s in selectors)
