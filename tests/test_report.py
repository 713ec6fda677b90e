"""The sweep report: `python -m analysis.report SWEEP_DIR` writes SWEEP_DIR/report/index.html with its
figures, from the records or from W&B, and a disagreement shows on the page.

Uses the real sweep of tests/wandb_sweep.py (framework=deepspeed,titan, 2 ranks, 2 steps).
"""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import pandas as pd
import pytest

import records
from analysis import reconcile
from analysis import report as REP
from tests.wandb_sweep import real_sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    return real_sweep(tmp_path_factory)


def _png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG, path
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


@pytest.mark.real
def test_report_cli_writes_the_page_and_prints_where(sweep):
    p = subprocess.run([sys.executable, "-m", "analysis.report", sweep], cwd=REPO, capture_output=True, text=True,
                       check=True)
    page = os.path.join(sweep, "report", "index.html")
    assert p.stdout.strip().splitlines()[-1] == f"report: {page}"
    html = open(page).read()
    for png in ("scatter.png", "memory.png", "comm.png", "timeline.png"):
        assert f"src='{png}'" in html
        w, h = _png_size(os.path.join(sweep, "report", png))
        assert w >= 800 and h >= 300
    recs = records.load(sweep)
    for rec in recs:  # every job and framework is on the page
        assert records.job_name(rec) in html and records.framework_variant(rec) in html
    n_steady = int((reconcile.table(recs).phase == "steady").sum())
    assert f"all {n_steady} steady rows agree: states and collectives to the byte" in html
    got = pd.read_csv(os.path.join(sweep, "report", "reconcile.csv"), keep_default_na=False)
    assert len(got) == len(reconcile.table(recs))
    # what is live at each job's peak: its largest census groups, each job once, within its measured peak
    assert "<h2>What is live at the peak</h2>" in html
    census = REP.census_table(recs)
    block = (census.job != "").cumsum()  # each job's rows: its head row and the groups under it
    heads = census[census.job != ""]
    assert sorted(heads.job) == sorted(records.job_name(r) for r in recs)
    for b, rows in census.groupby(block):
        head = rows.iloc[0]
        assert 1 <= len(rows) <= 8 and 0 < rows.bytes.sum() <= head["measured peak"] and head["predicted peak"] > 0


@pytest.mark.real
def test_report_from_wandb_has_the_same_table(sweep, tmp_path):
    assert REP.main([sweep, "--from-wandb", sweep, "--out", str(tmp_path / "wb")]) == 0
    assert REP.main([sweep, "--out", str(tmp_path / "rec")]) == 0
    a = open(tmp_path / "wb" / "reconcile.csv").read()
    assert a == open(tmp_path / "rec" / "reconcile.csv").read() and a.count("\n") > 1


@pytest.mark.real
def test_a_disagreement_shows_on_the_page(sweep, tmp_path):
    recs = copy.deepcopy(records.load(sweep))
    st = recs[0]["measurement"]["ranks"][1]["steps"][-1]["state"]
    st["optim_bytes"] += 1  # one byte the ledger did not predict
    st["resident_bytes"] += 1
    path = REP.write(recs, str(tmp_path), "perturbed")
    html = open(path).read()
    n_steady = int((reconcile.table(recs).phase == "steady").sum())
    assert f"2 of {n_steady} steady rows differ" in html
    mism = html.split("<h2>Mismatching rows</h2>", 1)[1]
    assert len(re.findall(r"<tr[ >]", mism)) == 3  # header + the two rows
    assert "optim_bytes" in mism and "resident_bytes" in mism


@pytest.mark.real
def test_math_text_in_a_job_dir_is_drawn_as_text(sweep, tmp_path):
    """A job dir named with `$...$` (matplotlib's math text, unparsable here) draws as plain text."""
    recs = copy.deepcopy(records.load(sweep))
    for r in recs:
        r["job_dir"] = os.path.join(str(tmp_path), "0_$\\frac{1}{$x")
    path = REP.write(recs, str(tmp_path / "r"), "math")
    assert all(os.path.getsize(tmp_path / "r" / f"{k}.png") > 0 for k in REP.FIGURES) and os.path.exists(path)


@pytest.mark.real
def test_comm_panel_sums_are_the_tables(sweep):
    recs = records.load(sweep)
    df = reconcile.table(recs)
    for rec in recs:
        t = REP.comm_by_dim_kind(rec, df)
        d = REP.last_steady(df[df.job == records.job_name(rec)])
        d = d[d.quantity.str.endswith("/buffer_bytes")]
        assert len(t) == d.quantity.nunique() > 0
        assert t.measured.sum() * d["rank"].nunique() == d.measured.sum()


def test_units_are_decimal_like_the_ledger():
    assert REP.human(0) == "0 B" and REP.human(4) == "4 B"
    assert REP.human(7_082_496) == "7.1 MB" and REP.human(1e9) == "1 GB" and REP.human(1500) == "1.5 kB"


def test_no_records_is_an_error(tmp_path, capsys):
    assert REP.main([str(tmp_path)]) == 1
    assert "no records" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # wandb-workspaces uses pydantic v1 validators
def test_wandb_report_object_builds_without_a_server():
    """Only the report object: saving it needs a W&B server, which this machine cannot reach (untested)."""
    pytest.importorskip("wandb_workspaces")
    rep = REP.build_wandb_report("ent", "proj", "sweep-1", 4, "train-ledger: sweep-1")
    grids = [b for b in rep.blocks if type(b).__name__ == "PanelGrid"]
    assert len(grids) == 2
    media = [k for p in grids[0].panels for k in p.media_keys]
    assert media == [f"report/{k}" for k in REP.FIGURES]
    assert all("Group') == 'sweep-1'" in g.runsets[0].filters for g in grids)
    bars = [p for p in grids[1].panels if type(p).__name__ == "BarPlot"]
    assert bars[0].metrics == [f"rank{r}/resident_bytes" for r in range(4)]


@pytest.mark.real
def test_compact_sweep_table_is_the_full_tables_last_step(sweep):
    """What `make demo` prints per job: one line per (job, rank), resident predicted/measured as in the
    full table's last step, collectives by kind with their measured counts, and the comm rows that
    differ (a changed measurement shows there)."""
    recs = records.load(sweep)
    df = reconcile.table(recs)
    c = reconcile.compact(recs, df)
    assert len(c) == df.groupby(["job", "rank"]).ngroups > 0
    for _, row in c.iterrows():
        d = df[(df.job == row.job) & (df["rank"] == row["rank"])]
        last = d[d.step == d.step.max()]
        res = last[last.quantity == "resident_bytes"].iloc[0]
        assert (row.resident_predicted, row.resident_measured) == (res.predicted, res.measured)
        for q, m in zip(last.quantity, last.measured):
            if q.endswith("/count"):
                assert f"{q.split('/')[1]} {q.split('/')[2]}×{int(m)}" in row["collectives (measured)"]
        assert row.comm_mismatches == 0
    from tests.wandb_sweep import _cache

    out = _cache["proc"].stdout  # the sweep printed it at its end, then the summary
    assert "resident_predicted" in out and "collectives (measured)" in out and "steady_mismatches" in out
    bad = copy.deepcopy(recs)
    st = bad[0]["measurement"]["ranks"][0]["steps"][-1]
    st["comm"][0]["count"] += 1
    c2 = reconcile.compact(bad)
    assert c2.comm_mismatches.iloc[0] >= 1


def test_reconcile_judges_steady_rows_and_not_a_peaks_parts():
    """The `judged` column and --mismatches: steady rows of states, collectives and peak totals are
    judged (the summary's steady_mismatches); a first step's rows and a peak's parts are shown, not
    judged, so they never count as mismatches."""
    df = pd.DataFrame([
        dict(job="j", rank=0, step=1, phase="steady", quantity="params_bytes", predicted=10, measured=11, abs_err=1,
             rel_err=0.1, bound_low=float("nan"), bound_high=float("nan"), race_bytes=0),
        dict(job="j", rank=0, step=1, phase="steady", quantity="peak_bytes", predicted=1000, measured=1005, abs_err=5,
             rel_err=0.005, bound_low=float("nan"), bound_high=float("nan"), race_bytes=0),
        dict(job="j", rank=0, step=1, phase="steady", quantity="peak/temporary_bytes", predicted=0, measured=50,
             abs_err=50, rel_err=float("inf"), bound_low=float("nan"), bound_high=float("nan"), race_bytes=0),
        dict(job="j", rank=0, step=0, phase="first", quantity="peak_bytes", predicted=1000, measured=2000,
             abs_err=1000, rel_err=1.0, bound_low=float("nan"), bound_high=float("nan"), race_bytes=0)])
    assert list(reconcile.judged(df)) == [True, True, False, False]
    bad = reconcile.mismatches(df)
    assert list(bad.quantity) == ["params_bytes"]  # the peak total is within 1%, the rest not judged


@pytest.mark.real
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # wandb-workspaces uses pydantic v1 validators
def test_wandb_report_without_a_key_writes_its_spec_and_says_nothing_was_saved(sweep, tmp_path, capsys, monkeypatch):
    """--wandb-report with no API key: the spec W&B would store is written (its run sets filter on the
    sweep's group, its media panels name the report's figures), nothing is sent, exit 1 saying so."""
    pytest.importorskip("wandb_workspaces")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no `wandb login` entry either
    monkeypatch.setenv("HOME", str(tmp_path))
    assert REP.main([sweep, "--out", str(tmp_path / "r"), "--wandb-report", "ent/proj"]) == 1
    err = capsys.readouterr().err
    assert "W&B report NOT saved: no W&B API key is configured" in err and "nothing was sent" in err
    spec = json.load(open(tmp_path / "r" / "wandb_report.json"))
    assert (spec["type"], spec["entity"], spec["project"]) == ("Report", "ent", "proj")
    assert [b["type"] for b in spec["blocks"]] == ["H1", "H2", "PanelGrid", "H2", "PanelGrid"]
    text = json.dumps(spec)
    group = (records.load(sweep)[0].get("wandb") or {}).get("group")
    assert group and f"{group}" in text and all(f"report/{k}" in text for k in REP.FIGURES)
    assert REP.main([sweep, "--out", str(tmp_path / "r2"), "--wandb-report", "no-slash"]) == 2
