"""bench/propose.py's timeline summary: what each kernel adds to a step's span when launches overlap."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "propose.py"


@pytest.fixture(scope="module")
def propose():
    spec = importlib.util.spec_from_file_location("bench_propose", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_adds_sum_to_the_span_when_a_launch_ends_inside_an_earlier_one(propose):
    # a: 0-10; b starts early (dependent launch) and ends at 25; c runs inside b (0 added); a gap of 5;
    # a again 30-32; d overlaps a's tail and ends at 40
    timeline = [
        {"node": "n0", "kernel": "a", "start": 0.0, "end": 10.0},
        {"node": "n1", "kernel": "b", "start": 8.0, "end": 25.0},
        {"node": "n2", "kernel": "c", "start": 12.0, "end": 20.0},
        {"node": "n3", "kernel": "a", "start": 30.0, "end": 32.0},
        {"node": "n4", "kernel": "d", "start": 31.0, "end": 40.0},
    ]
    summary = propose.timeline_summary(timeline)
    assert summary["span"] == 40.0
    assert summary["busy"] == 10 + 17 + 8 + 2 + 9
    assert summary["idle"] == 5.0  # 25 → 30
    rows = {r["kernel"]: (r["launches"], r["adds"]) for r in summary["kernels"]}
    assert rows == {"a": (2, 10.0 + 7.0), "b": (1, 15.0), "c": (1, 0.0), "d": (1, 8.0)}
    assert sum(adds for _, adds in rows.values()) == summary["span"]
    assert [r["kernel"] for r in summary["kernels"]] == ["a", "b", "d", "c"]  # most added first
