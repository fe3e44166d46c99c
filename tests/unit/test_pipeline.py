"""The pass pipeline: after every pass the graphs verify and interpret to the same drafts as before it."""

from __future__ import annotations

import pytest
from pass_harness import TINY, assert_equivalent, run, tiny

from dflash_compiler.ir import dump
from dflash_compiler.ir_passes.context import PassContext
from dflash_compiler.options import BuildOptions
from dflash_compiler.pipeline import PASSES, apply_pass

OPTIONS = BuildOptions(max_batch=4, max_seq_len=256, max_ctx_rows=64)
EQUIVALENCE = {"rtol": 1e-4, "atol": 1e-4}  # fused GEMMs sum in another order (fp32 rounding)


@pytest.mark.parametrize("name", TINY)
def test_every_pass_preserves_the_drafts(name):
    t = tiny(name)
    ctx = PassContext(t.config, OPTIONS, t.tensors.__getitem__)
    program = t.program
    before = run(program, t.tensors)
    for label, step in PASSES:
        program = apply_pass(program, step, ctx, check=True)  # verify() after every pass
        after = run(program, t.tensors)
        try:
            assert_equivalent(before, after, **EQUIVALENCE)
        except AssertionError as err:
            raise AssertionError(f"{label} changed the result of {name}") from err
        before = after


def test_plans_are_recorded_on_both_phases():
    t = tiny("tiny-dflash")
    ctx = PassContext(t.config, OPTIONS)
    program = t.program
    for _, step in PASSES:
        program = apply_pass(program, step, ctx, check=True)
    for graph in program.phases.values():
        assert {"kv_cache", "memory", "precision", "rope"} <= set(graph.meta)
        assert "meta kv_cache = kv " in dump(graph)


def test_size_kv_cache_golden_lines():
    """size_kv_cache changes no node; it adds exactly one meta line with the sizing."""
    from dflash_compiler.ir_passes.size_kv_cache import size_kv_cache

    t = tiny("tiny-dflash")
    ctx = PassContext(t.config, OPTIONS)
    before = dump(t.program.propose)
    after = dump(size_kv_cache(t.program.propose, ctx))
    added = [line for line in after.splitlines() if line not in before.splitlines()]
    # tiny-dflash: block 8, max_seq_len 256 -> ceil(265 / 16) = 17 pages per sequence, 4 x 17 + 1 pages,
    # 3 layers x K,V x 16 rows x 2 kv heads x 16 dims x 2 bytes = 6144 bytes a page.
    assert len(added) == 1
    assert added[0].startswith("meta kv_cache = kv 69 pages x 6144 B")
    assert "17 pages/seq" in added[0]


def test_exclude_glob_matching_nothing_is_refused():
    from dflash_compiler.pipeline import optimize
    from dflash_compiler.plans import PlanError

    t = tiny("tiny-dflash")
    program = optimize(t.config, BuildOptions(precision="fp8", exclude=("fc", "lm_head")))
    assert program.append_context.meta["precision"].unmatched_exclude == ("lm_head",)  # propose has it
    with pytest.raises(PlanError) as err:
        optimize(t.config, BuildOptions(precision="fp8", exclude=("layers.9.*", "lm_head", "fc_typo")))
    assert [p.where for p in err.value.problems] == ["exclude 'fc_typo'", "exclude 'layers.9.*'"]
    assert "matches no linear" in str(err.value)


def test_knob_overrides_parse_and_refuse_a_bad_spelling_or_a_repeat():
    from pydantic import ValidationError

    from dflash_compiler.errors import InputError
    from dflash_compiler.options import knob_overrides

    assert knob_overrides(["rmsnorm.threads=64", "block_attention.splits = 2", "rmsnorm.vector_bytes=8"]) == {
        "rmsnorm": {"threads": 64, "vector_bytes": 8},
        "block_attention": {"splits": 2},
    }
    assert knob_overrides([]) == {}
    with pytest.raises(InputError) as err:
        knob_overrides(["rmsnorm.threads=64", "rmsnorm", "rmsnorm.threads=32", "a.b=1.5", "a . b=1"])
    assert [p.found for p in err.value.problems] == ["'rmsnorm'", "'rmsnorm.threads=32'", "'a.b=1.5'", "'a . b=1'"]
    assert "already 64" in str(err.value) and "RULE.KNOB=INT" in str(err.value)
    with pytest.raises(ValidationError):
        BuildOptions(knobs={"rmsnorm": {"threads": "64"}})  # an int, not text that reads as one
    with pytest.raises(ValidationError):
        BuildOptions(knobs={"rmsnorm": {"threads": True}})
