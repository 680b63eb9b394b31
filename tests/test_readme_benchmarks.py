"""The README's benchmark table is what scripts/readme_benchmarks.py renders from docs/benchmarks.md's summary now."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.readme_benchmarks import SummaryError, current, render, summary_rows

REPO = Path(__file__).resolve().parent.parent

SUMMARY = """## Summary

| run | system | peer | world | metric | ratio | target | met? |
|-----|--------|------|-------|--------|-------|--------|------|
| dp-w2 | tiers stage 0 | torch DDP | 2 | step time | 1.016 | ≤ 1.0 | **no** |
| tp-w2 | tiers 1D | DTensor | 2 | step time | 0.933 | ≤ 1.0 | yes |
| tp-w2 | tiers 1D, derived | DTensor | 2 | step time | 0.969 | ≤ 1.0 | yes |
| pipeline-w2 | zero bubble bubble | 1f1b bubble | 2 | bubble | 0.758 | — | — |

## Plots
"""


def test_the_readme_table_is_current():
    text, fresh = current(REPO / "README.md")
    assert text == fresh, "run: python scripts/readme_benchmarks.py --write README.md"


def test_the_table_counts_and_groups_the_summary_rows():
    table = render(summary_rows(SUMMARY))
    lines = table.splitlines()
    assert lines[0] == "2 of 3 ratios met."  # the row without a target counts in neither
    assert "| step time 1.016 (≤ 1.0) | 0 of 1 |" in lines[4]
    assert "| step time 0.933 / 0.969 (≤ 1.0) | 2 of 2 |" in lines[5]
    assert lines[6].endswith("| bubble 0.758 | — |")


def test_a_run_without_a_label_fails_the_rendering():
    with pytest.raises(SummaryError, match="new-run"):
        render(summary_rows(SUMMARY.replace("| dp-w2 |", "| new-run |")))
