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


def _ran(node: str, kernel: str, start: float, end: float) -> dict:
    """One timeline entry: `kernel` of `node` ran from `start` to `end` µs."""
    return {"node": node, "kernel": kernel, "start": start, "end": end}


def test_adds_sum_to_the_span_when_a_launch_ends_inside_an_earlier_one(propose):
    # a: 0-10; b starts early (dependent launch) and ends at 25; c runs inside b (0 added); a gap of 5;
    # a again 30-32; d overlaps a's tail and ends at 40
    timeline = [
        _ran("n0", "a", 0.0, 10.0),
        _ran("n1", "b", 8.0, 25.0),
        _ran("n2", "c", 12.0, 20.0),
        _ran("n3", "a", 30.0, 32.0),
        _ran("n4", "d", 31.0, 40.0),
    ]
    summary = propose.timeline_summary(timeline)
    assert summary["span"] == 40.0
    assert summary["busy"] == 10 + 17 + 8 + 2 + 9
    assert summary["idle"] == 5.0  # 25 → 30
    rows = {r["kernel"]: (r["launches"], r["adds"]) for r in summary["kernels"]}
    assert rows == {"a": (2, 10.0 + 7.0), "b": (1, 15.0), "c": (1, 0.0), "d": (1, 8.0)}
    assert sum(adds for _, adds in rows.values()) == summary["span"]
    assert [r["kernel"] for r in summary["kernels"]] == ["a", "b", "d", "c"]  # most added first


def _manifest(weight_bytes: int):
    """A two-phase step: append streams `fc`; propose gathers from `table`, streams `l0.w`, `l1.w` and
    `lm` (and `norm`, read by both phases), and has one attention per layer over the cache."""
    from types import SimpleNamespace as NS

    def call(node, *buffers):
        return NS(node=node, buffers=[NS(param=p, value=v) for p, v in buffers])

    weights = {
        "fc": NS(shape=[100, 10], dtype="bfloat16"),  # 2000 bytes
        "table": NS(shape=[1000, 10], dtype="bfloat16"),
        "norm": NS(shape=[10], dtype="float32"),  # 40
        "l0.w": NS(shape=[50, 10], dtype="float8_e4m3fn"),  # 500
        "l1.w": NS(shape=[50, 10], dtype="float8_e4m3fn"),
        "lm": NS(shape=[300, 10], dtype="bfloat16"),  # 6000
    }
    append = NS(calls=[call("fc", ("x", "taps"), ("w", "fc")), call("ctx_norm", ("x", "fc"), ("w", "norm"))])
    propose = NS(
        calls=[
            call("embed", ("anchors", "anchors"), ("table", "table")),
            call("input_norm", ("x", "embed"), ("w", "norm")),
            call("l0.qkv", ("x", "input_norm"), ("w", "l0.w")),
            call("l0.attention", ("q", "l0.qkv"), ("kv", "kv_cache")),
            call("l1.qkv", ("x", "l0.attention"), ("w", "l1.w")),
            call("l1.attention", ("q", "l1.qkv"), ("kv", "kv_cache")),
            call("argmax", ("x", "l1.attention"), ("w", "lm")),
        ]
    )
    roofline = NS(weight_bytes=weight_bytes, context_weight_bytes=2000, kv_bytes_per_cached_row=8)
    return NS(weights=weights, phases={"append_context": append, "propose": propose}, roofline=roofline)


def test_node_floors_are_each_nodes_bytes_at_copy_speed_and_add_up_to_the_roofline(propose):
    bandwidth = 1e9  # 1000 bytes per µs
    floors = propose.node_floors(_manifest(40 + 500 + 500 + 6000), nb=2, bandwidth=bandwidth)
    kv = 2 * (propose.CACHED + propose.NEW_ROWS) * 8 / 2 / 1000  # each layer's half of both sequences' K/V
    assert floors == pytest.approx(
        {
            "fc": 2.0,
            "ctx_norm": 0.04,  # the shared weight counts once, at its first reader
            "embed": 0.0,  # a gathered table is not streamed
            "input_norm": 0.0,
            "l0.qkv": 0.5,
            "l0.attention": kv,
            "l1.qkv": 0.5,
            "l1.attention": kv,
            "argmax": 6.0,
        }
    )
    with pytest.raises(RuntimeError, match=r"floors add up to .* expected them equal"):
        propose.node_floors(_manifest(12345), nb=2, bandwidth=bandwidth)


def test_beyond_roofline_groups_layers_and_its_differences_add_up_to_span_minus_floors(propose):
    timeline = [
        _ran("l0.qkv", "mm", 0.0, 10.0),
        _ran("l0.attention", "split", 9.0, 20.0),
        _ran("l0.attention", "merge", 20.0, 23.0),
        _ran("l1.qkv", "mm", 22.0, 30.0),
        _ran("l1.attention", "split", 31.0, 40.0),
    ]
    floors = {"l0.qkv": 8.0, "l1.qkv": 8.0, "l0.attention": 2.0, "l1.attention": 2.0}
    rows = propose.beyond_roofline(timeline, floors)
    assert [(r["node"], r["launches"], r["adds"], r["floor"]) for r in rows] == [
        ("attention", 3, 10.0 + 3.0 + 10.0, 4.0),  # over 19
        ("qkv", 2, 10.0 + 7.0, 16.0),  # over 1
    ]
    assert sum(r["over"] for r in rows) == 40.0 - sum(floors.values())
