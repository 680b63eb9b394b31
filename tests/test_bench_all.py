"""scripts/bench_all.py's report writer, on records made by the benchmark scripts' own helpers (no benchmark runs)."""

import json
import math
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import bench_all  # noqa: E402
from bench_common import read_results, result_record, write_results  # noqa: E402
from bench_report import Run, parse_note, render  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def training_records(benchmark, strategy, ours, peer, world, ratio, target, ours_tps, peer_tps, ours_rss, peer_rss):
    return [result_record(benchmark, ours, world=world, peer=peer, strategy=strategy, ratio=ratio, target=target,
                          step_s=1.0 / ours_tps, throughput=ours_tps, unit="tokens/s",
                          peak_rss_per_rank_bytes=ours_rss),
            result_record(benchmark, peer, world=world, role="peer", strategy=strategy, step_s=1.0 / peer_tps,
                          throughput=peer_tps, unit="tokens/s", peak_rss_per_rank_bytes=peer_rss)]


# (run id, title, world, records): ratios on both sides of their targets, both directions, and one not a number
CASES = [
    ("dp-w2", "Data parallelism", 2,
     training_records("dp", "DP (stage 0)", "tiers stage 0", "torch DDP", 2, 0.97, 1.0, 4000.0, 3880.0, 4.1e8, 4.2e8)),
    ("zero2-w2", "ZeRO stage 2", 2,
     training_records("zero", "ZeRO-2", "tiers ZeRO stage 2", "torch DDP", 2, 1.07, 1.05, 3600.0, 3850.0, 3.9e8,
                      4.2e8)),
    ("offload", "NVMe tier", None,
     [result_record("offload", "store write", world=1, peer="raw Python write", metric="write MB/s ÷ best raw",
                    ratio=0.83, target=0.8, better="higher", throughput=1660.0, unit="MB/s"),
      result_record("offload", "store read", world=1, peer="raw Python read", metric="read MB/s ÷ best raw",
                    ratio=0.61, target=0.8, better="higher", throughput=1220.0, unit="MB/s"),
      result_record("offload", "raw Python write", world=1, role="peer", metric="write MB/s", throughput=2000.0,
                    unit="MB/s")]),
    ("zero_nvme", "ZeRO-3 through NVMe", None,
     [result_record("zero_nvme", "nvme, nothing moved", world=2, peer="raw disk", metric="step ÷ disk time",
                    ratio=float("nan"), target=1.5, step_s=0.1)]),
]


def recorded_runs(tmp_path):
    """The cases' records written and read back as the scripts and bench_all do, each with a report."""
    runs = []
    for run_id, title, world, records in CASES:
        path = tmp_path / f"{run_id}.json"
        write_results(str(path), records)
        runs.append(Run(run_id, title, world, f"python scripts/x.py --id {run_id}", 12.0, 0,
                        report=f"### report of {run_id}\n\n| table of {run_id} |", records=read_results(str(path))))
    return runs


def expected_met(record):
    if math.isnan(record["ratio"]):
        return "—"
    ok = record["ratio"] >= record["target"] if record["better"] == "higher" else record["ratio"] <= record["target"]
    return "yes" if ok else "**no**"


def summary_table(text):
    section = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| ")]
    header, body = rows[0], rows[1:]
    return [dict(zip(header, r)) for r in body]


def test_results_json_round_trips(tmp_path):
    records = [r for _, _, _, rs in CASES for r in rs]
    records.append(result_record("tp", "tiers 2D", world=4, peer="DTensor", ratio=1.3, target=1.0,
                                 saved_activation_bytes=131_100_000, model="bench30m"))
    path = tmp_path / "out" / "r.json"
    write_results(str(path), records)
    back = read_results(str(path))
    assert len(back) == len(records)
    for a, b in zip(records, back):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], float) and math.isnan(a[k]):
                assert math.isnan(b[k])
            else:
                assert a[k] == b[k], k
    doc = json.loads(path.read_text().replace("NaN", "null"))
    doc["format"] = 0
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="format"):
        read_results(str(path))


def test_result_record_refuses_what_it_cannot_report():
    with pytest.raises(ValueError, match="unit"):
        result_record("dp", "x", world=2, throughput=1.0)
    with pytest.raises(ValueError, match="role"):
        result_record("dp", "x", world=2, role="baseline")
    with pytest.raises(ValueError, match="better"):
        result_record("dp", "x", world=2, better="smaller")


def test_report_has_every_ratio_against_its_target_and_every_report_and_note(tmp_path):
    runs = recorded_runs(tmp_path)
    runs.append(Run("zero3-w2", "ZeRO stage 3", 2, "python scripts/bench_zero.py --stage 3", 3.0, 1))  # failed
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "dp-w2.md").write_text("<!-- run: 2026-11-21, bench_dp alone -->\nWhat dp does.\n<!-- report -->\n"
                                    "Reading it: dp at parity.\n")
    (notes / "offload.md").write_text("<!-- run: this run -->\nReading it: the store is fast.\n")
    text = render(runs, this_run="this run", command="python scripts/bench_all.py", machine="a machine, 2 cores",
                  quick=False, plots=[], plots_skipped="Plots skipped: no matplotlib.", notes_dir=str(notes),
                  total_s=600.0)

    compared = [r for run in runs for r in run.records if r["role"] == "ours"]
    table = summary_table(text)
    assert [row["system"] for row in table] == [r["system"] for r in compared]  # peers and references: no rows
    for row, r in zip(table, compared):
        assert row["ratio"] == ("n/a" if math.isnan(r["ratio"]) else f"{r['ratio']:.3f}")
        assert row["met?"] == expected_met(r), row
        assert row["target"].startswith("≥" if r["better"] == "higher" else "≤")
        assert row["peer"] == r["peer"] and row["world"] == str(r["world"])
    assert [row["met?"] for row in table] == ["yes", "**no**", "yes", "**no**", "—"]  # both sides of each target
    assert "Failed, no figures: zero3-w2 (exit 1)" in text
    assert "Plots skipped: no matplotlib." in text and "a machine, 2 cores" in text and "Quick" not in text

    for run in runs[:-1]:
        assert run.report in text
    dp = text.index("### report of dp-w2")
    assert text.index("What dp does.") < dp < text.index("Reading it: dp at parity.")
    assert "*Notes written for an earlier run (2026-11-21, bench_dp alone)" in text
    offload = text.split("### report of offload", 1)[1].split("\n## ", 1)[0]
    assert "Reading it: the store is fast." in offload and "earlier run" not in offload  # written for this run


def test_quick_report_says_so(tmp_path):
    text = render(recorded_runs(tmp_path), this_run="now (quick)", command="bench_all --quick", machine="m",
                  quick=True, plots=[], plots_skipped="skipped", notes_dir=None, total_s=60.0)
    assert text.startswith("# Benchmarks (quick run: not measurements)")
    assert "**not measurements**" in text and "## Summary (quick run)" in text


def test_plots_pair_each_system_with_its_own_peer(tmp_path):
    from bench_plots import pairs

    records = [r for run in recorded_runs(tmp_path) for r in run.records]
    by_world = pairs(records, "throughput")
    assert sorted(by_world) == [2] and [(o, p) for _, o, p in by_world[2]] == [(4000.0, 3880.0), (3600.0, 3850.0)]
    two_peers = [result_record("tp", "peer A", world=4, role="peer", throughput=100.0, unit="tokens/s"),
                 result_record("tp", "peer B", world=4, role="peer", throughput=200.0, unit="tokens/s"),
                 result_record("tp", "ours", world=4, peer="peer B", strategy="TP", ratio=0.5, target=1.0,
                               throughput=400.0, unit="tokens/s"),
                 result_record("tp", "ours, no peer measured", world=4, peer="peer C", ratio=1.0, target=1.0,
                               throughput=1.0, unit="tokens/s")]
    assert [(o, p) for _, o, p in pairs(two_peers, "throughput")[4]] == [(400.0, 200.0)]
    assert pairs(two_peers, "peak_rss_per_rank_bytes") == {}  # no memory measured: nothing to plot


def test_plots_are_png_files(tmp_path):
    pytest.importorskip("matplotlib")
    from bench_plots import write_plots

    records = [r for run in recorded_runs(tmp_path) for r in run.records]
    paths = write_plots(records, str(tmp_path / "plots"), quick=True, machine="m")
    assert sorted(os.path.basename(p) for p in paths) == ["memory.png", "throughput.png"]
    for p in paths:
        data = Path(p).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000


def write_recorded_run(results, runs, quick=False):
    """A results directory as bench_all leaves it: each script's markdown and JSON, and run.json."""
    meta = {"run": "2026-11-22 06:00 UTC", "command": "python scripts/bench_all.py", "machine": "m", "quick": quick,
            "worlds": None, "dir": None, "total_s": 10.0, "runs": []}
    for run in runs:
        (results / f"{run.id}.md").write_text(run.report)
        write_results(str(results / f"{run.id}.json"), run.records)
        meta["runs"].append({"id": run.id, "seconds": run.seconds, "returncode": run.returncode})
    (results / "run.json").write_text(json.dumps(meta))


def test_render_only_rewrites_the_report_from_a_results_directory(tmp_path, monkeypatch):
    runs = [r for r in recorded_runs(tmp_path) if r.id in ("dp-w2", "zero2-w2", "offload")]
    results = tmp_path / "results"
    results.mkdir()
    write_recorded_run(results, runs)
    out = tmp_path / "docs" / "benchmarks.md"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where matplotlib is not installed
    assert bench_all.main(["--render-only", "--results", str(results), "--out", str(out),
                           "--notes", str(tmp_path / "no-notes")]) == 0
    text = out.read_text()
    assert [row["run"] for row in summary_table(text)] == ["dp-w2", "zero2-w2", "offload", "offload"]
    assert "pip install matplotlib" in text and not (tmp_path / "docs" / "benchmarks").exists()
    assert "## ZeRO stage 2 vs torch DDP (2 ranks)" in text and "### report of zero2-w2" in text


def test_every_note_belongs_to_a_run_bench_all_makes():
    ids = {p.id for worlds in (None, [2, 4]) for p in bench_all.plan(None, worlds, False, None)}
    notes = sorted((REPO / "docs" / "benchmark_notes").glob("*.md"))
    assert notes
    for path in notes:
        assert path.stem in ids, f"{path.name}: no run {path.stem!r} in scripts/bench_all.py ({sorted(ids)})"
        note = parse_note(path.read_text())
        assert note.run and note.after, f"{path.name}: needs a '<!-- run: ... -->' first line and notes"


def option(args, name):
    """The value a script would parse for `name` (argparse: the last occurrence wins), None when absent."""
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]
    return values[-1] if values else None


def test_world_sizes_reach_the_scripts_with_heads_that_divide():
    full = {p.id: p.args for p in bench_all.plan(["tp", "dp"], [2, 4], False, None)}
    quick = {p.id: p.args for p in bench_all.plan(["tp"], [4], True, None)}
    assert sorted(full) == ["dp-w2", "dp-w4", "tp-w2", "tp-w4"] and list(quick) == ["tp-w4"]
    assert [option(full[i], "--world") for i in ("dp-w2", "dp-w4", "tp-w2", "tp-w4")] == ["2", "4", "2", "4"]
    assert option(full["tp-w2"], "--n-head") is None and option(full["dp-w4"], "--n-head") is None
    assert option(full["tp-w4"], "--n-head") == "8"   # bench30m's 10 heads do not split over 4 ranks
    assert option(quick["tp-w4"], "--n-head") == "4"  # nor tiny's 2
    assert option(quick["tp-w4"], "--model") == "tiny" and option(full["tp-w4"], "--model") is None
