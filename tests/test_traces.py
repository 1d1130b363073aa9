"""Trace readers: Bamboo/Oobleck CSV, per-tick availability JSON (with the value-meaning option),
format detection, windows, bundled traces, and the synthetic generator."""

from __future__ import annotations

import hashlib
import json

import pytest

from fleetd.sim.traces import (
    ADD,
    REMOVE,
    SyntheticPool,
    TraceError,
    TraceFormat,
    ValueMeaning,
    all_or_none_share,
    detect_format,
    load_trace,
    read_availability_json,
    read_bamboo_csv,
    resolve_trace_path,
    synthetic_trace,
)
from tests.harness.traces import BUNDLED, UPSTREAM_SHA256, trace_file


def _doc(data, gap=60):
    return json.dumps({"metadata": {"gap_seconds": gap}, "data": data})


def test_bamboo_csv_live_count_follows_adds_and_removes():
    text = "0,add,node1\n0,add,node2\n60000,add,node3\n120000,remove,node1\n180000,remove,node3\n"
    tr = read_bamboo_csv(text, "t")
    assert [(e.t, e.kind, e.node) for e in tr.events][:3] == [
        (0.0, ADD, "node1"),
        (0.0, ADD, "node2"),
        (60.0, ADD, "node3"),
    ]
    assert tr.duration_s == 180.0
    assert [tr.live_at(t) for t in (0, 59, 60, 119, 120, 180)] == [2, 2, 3, 3, 2, 1]
    assert tr.max_live == 3
    assert tr.removals() == 2
    # 2 nodes x 60 s + 3 x 60 s + 2 x 60 s
    assert tr.node_seconds() == pytest.approx(420.0)


@pytest.mark.parametrize(
    "text, message",
    [
        ("0,add\n", "expected time_ms,add|remove,node"),
        ("x,add,n1\n", "not a number"),
        ("-5,add,n1\n", ">= 0"),
        ("0,join,n1\n", "not add or remove"),
        ("0,remove,n1\n", "never added"),
        ("0,add,n1\n10,add,n1\n", "already live"),
        ("\n\n", "no events"),
    ],
)
def test_bamboo_csv_rejects_bad_rows_with_a_line_number(text, message):
    with pytest.raises(TraceError, match=message):
        read_bamboo_csv(text, "bad")


def test_bamboo_csv_error_names_file_and_line():
    with pytest.raises(TraceError, match=r"bad:2:"):
        read_bamboo_csv("0,add,n1\n5,teleport,n1\n", "bad")


def test_the_shared_p3_trace_matches_its_readme():
    tr = load_trace(trace_file("p3-trace.csv"))
    assert len(tr.events) == 344
    assert tr.duration_s / 3600 == pytest.approx(11.4, abs=0.05)
    assert tr.max_live == 32
    assert tr.mean_live() == pytest.approx(24, abs=0.5)
    assert tr.removals() / (tr.duration_s / 3600) == pytest.approx(14.7, abs=0.1)


def test_bundled_traces_are_found_by_name_and_match_the_shared_copy():
    assert resolve_trace_path("p3").name == "p3-trace.csv"
    assert resolve_trace_path("g4dn-trace.csv").name == "g4dn-trace.csv"
    assert (resolve_trace_path("p3").parent / "LICENSE.upstream").is_file()
    for name, digest in UPSTREAM_SHA256.items():
        bundled = resolve_trace_path(name) if "trace" in name else BUNDLED / name
        assert hashlib.sha256(bundled.read_bytes()).hexdigest() == digest, name
    with pytest.raises(TraceError, match="does not exist"):
        resolve_trace_path("no-such-trace")


@pytest.mark.parametrize(
    "meaning, data, expected",
    [
        (ValueMeaning.AVAILABLE, [1, 1, 0, 0, 1], [1, 1, 0, 0, 1]),
        (ValueMeaning.PREEMPTED, [1, 1, 0, 0, 1], [0, 0, 1, 1, 0]),
        (ValueMeaning.COUNT, [3, 1, 0, 2, 2], [3, 1, 0, 2, 2]),
        (ValueMeaning.AVAILABLE, [True, False], [1, 0]),
    ],
)
def test_availability_json_value_meanings(meaning, data, expected):
    tr = read_availability_json(_doc(data, gap=600), meaning)
    assert [tr.live_at(i * 600) for i in range(len(data))] == expected
    assert tr.duration_s == 600 * len(data)


def test_availability_json_count_removes_and_adds_named_nodes():
    tr = read_availability_json(_doc([2, 1, 3]), "count")
    kinds = [(e.t, e.kind) for e in tr.events]
    assert kinds == [(0, ADD), (0, ADD), (60, REMOVE), (120, ADD), (120, ADD)]
    assert len({e.node for e in tr.events if e.kind == ADD}) == 4


@pytest.mark.parametrize(
    "doc, meaning, message",
    [
        (_doc([0, 2]), "available", "takes 0/1 only"),
        (_doc([0, 2]), "preempted", "takes 0/1 only"),
        (_doc([0, -1]), "count", "non-negative whole number"),
        (_doc([0.5]), "count", "non-negative whole number"),
        (_doc(["1"]), "count", "non-negative whole number"),
        (_doc([1], gap=0), "available", "gap_seconds must be a positive number"),
        (json.dumps({"data": [1]}), "available", "gap_seconds"),
        (json.dumps({"metadata": {"gap_seconds": 60}}), "available", '"data"'),
        (_doc([]), "available", "data is empty"),
        ("{not json", "available", "not valid JSON"),
    ],
)
def test_availability_json_rejects_bad_input(doc, meaning, message):
    with pytest.raises(TraceError, match=message):
        read_availability_json(doc, meaning, "x")


def test_unknown_meaning_is_an_error():
    with pytest.raises(ValueError):
        read_availability_json(_doc([1]), "maybe")


def test_format_is_detected_from_content_not_name(tmp_path):
    as_json = tmp_path / "looks.csv"
    as_json.write_text("  " + _doc([1, 0, 1]))
    as_csv = tmp_path / "looks.json"
    as_csv.write_text("0,add,a\n1000,remove,a\n")
    assert detect_format(as_json.read_text()) is TraceFormat.AVAILABILITY_JSON
    assert detect_format(as_csv.read_text()) is TraceFormat.BAMBOO_CSV
    assert load_trace(as_json).live_at(60) == 0
    assert load_trace(as_json, "preempted").live_at(60) == 1
    assert load_trace(as_csv).removals() == 1


def test_window_rebases_time_and_turns_live_nodes_into_adds():
    tr = read_bamboo_csv("0,add,a\n0,add,b\n100000,remove,a\n200000,add,c\n300000,remove,b\n", "t")
    w = tr.window(150.0)
    assert w.duration_s == pytest.approx(150.0)
    assert [(e.t, e.kind, e.node) for e in w.events] == [(0.0, ADD, "b"), (50.0, ADD, "c"), (150.0, REMOVE, "b")]
    assert w.live_at(0) == 1 and w.live_at(60) == 2 and w.live_at(150) == 1
    with pytest.raises(ValueError):
        tr.window(300.0)


def test_synthetic_rates_and_pool_wide_correlation():
    pools = [
        SyntheticPool("a", nodes=8, interruptions_per_hour=0.2, mean_outage_s=1800, pool_wide_share=0.95),
        SyntheticPool("b", nodes=4, interruptions_per_hour=0.5, mean_outage_s=900, pool_wide_share=0.95),
    ]
    days = 60
    tr = synthetic_trace(pools, days * 86400.0, seed=7)
    assert set(tr.pools()) == {"a", "b"}
    # Interruption events (one per removal time) arrive at the configured rate while up.
    for pool, rate, outage in (("a", 0.2, 1800), ("b", 0.5, 900)):
        times = {e.t for e in tr.events if e.pool == pool and e.kind == REMOVE}
        up_hours = days * 24 / (1 + rate * outage / 3600)
        assert len(times) / up_hours == pytest.approx(rate, rel=0.2)
    # Real traces: > 94 % of the time all or none of a pool's nodes are available.
    assert all_or_none_share(tr, "a", 8) > 0.94
    assert all_or_none_share(tr, "b", 4) > 0.94


def test_synthetic_single_node_availability_matches_rate_and_outage():
    tr = synthetic_trace([SyntheticPool("s", 1, 0.25, 2 * 3600.0, 1.0)], 400 * 86400.0, seed=3)
    expected = 1 / (1 + 0.25 * 2)  # up ~4 h, down ~2 h on average
    assert tr.mean_live() == pytest.approx(expected, abs=0.04)
    assert synthetic_trace([SyntheticPool("s", 1, 0.25, 7200.0, 1.0)], 400 * 86400.0, seed=3).events == tr.events


def test_synthetic_rejects_nonsense():
    with pytest.raises(ValueError):
        synthetic_trace([SyntheticPool("x", nodes=0)], 3600.0)
