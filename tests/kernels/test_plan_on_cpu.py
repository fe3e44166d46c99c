"""Both phases of every tiny family, run as their kernel plans on the CPU (each call the llvm build of its
kernel's unscheduled PrimFunc), reproduce the numpy interpreter: kernel choice, parameter and view
bindings, size bindings and the kernels' computations, end to end. The CUDA schedules are the GPU tests' part.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dflash_compiler.checkpoint import example_config_path
from dflash_compiler.config import load_drafter_config
from dflash_compiler.graph_runner import GraphDrafter
from dflash_compiler.ir.ops import Op
from dflash_compiler.ir.weights import WeightCache
from dflash_compiler.options import BuildOptions
from dflash_compiler.runtime.pages import PageAllocator
from dflash_compiler.runtime.steps import context_step, propose_step
from dflash_compiler.synth import random_drafter_weights, random_target_weights
from dflash_compiler.targets import SM90

pytest.importorskip("tvm")

from plan_runner import run_plan_on_cpu

TINY = ("tiny-dflash", "tiny-dflash-yarn", "tiny-dflash2", "tiny-dspark")
PROMPTS = (5, 17, 30)


@pytest.mark.parametrize("name", TINY)
def test_kernel_plans_match_the_interpreter(name):
    from dflash_compiler.kernel_build import schedule_program
    from dflash_compiler.pipeline import optimize

    cfg = load_drafter_config(example_config_path(name))
    target = random_target_weights(cfg, 0, tied=cfg.tie_word_embeddings)
    tensors = {
        **random_drafter_weights(cfg, 0),
        "target.embed_tokens": target["embed_tokens"],
        "target.lm_head": target["lm_head"],
    }
    program = optimize(cfg, BuildOptions(max_batch=4, max_seq_len=256, max_ctx_rows=64))
    plans, _ = schedule_program(program, SM90)
    interp = GraphDrafter(program, tensors, num_pages=64, max_seq_len=256)
    weights = WeightCache(tensors)
    rng = np.random.default_rng(0)
    kv = {"kv_cache": interp.kv.astype(ml_dtypes.bfloat16)}
    seqs = list(range(len(PROMPTS)))
    for s in seqs:
        interp.create(s)
    # append_context: the same rows through the interpreter and through the kernel plan
    taps = [rng.standard_normal((n, cfg.fc_in_features)).astype(np.float32) for n in PROMPTS]
    positions = [np.arange(n) for n in PROMPTS]
    interp.append_context(seqs, taps, positions)
    pages = PageAllocator(64, 16, 256)
    for s in seqs:
        pages.create(s)
    step = context_step(pages, seqs, positions)
    run_plan_on_cpu(
        program.append_context,
        plans["append_context"],
        {"taps": np.concatenate(taps), "ctx_positions": step.positions, "ctx_slots": step.slots},
        weights,
        kv,
        {"ctx": len(step.slots), "pages": 64},
    )
    cached = kv["kv_cache"].astype(np.float32)
    written = np.abs(interp.kv) > 0
    err = np.abs(cached - interp.kv)[written]
    rms = float(np.sqrt(np.mean(interp.kv[written] ** 2)))
    assert written.sum() == 2 * cfg.num_layers * sum(PROMPTS) * cfg.num_kv_heads * cfg.head_dim
    assert np.max(err) < 3e-2 * rms, f"cached K/V differ from the interpreter by up to {np.max(err) / rms:.3f} rms"
    # propose, from the plan's own cache
    anchors = [3, 7, 11]
    want = interp.propose(seqs, anchors)
    block = cfg.block_size
    ps = propose_step(pages, seqs, block)
    values: dict[str, np.ndarray] = {}
    out = run_plan_on_cpu(
        program.propose,
        plans["propose"],
        {
            "anchors": np.asarray(anchors, np.int32),
            "blk_positions": ps.positions,
            "block_table": ps.block_table,
            "cache_lens": ps.cache_lens,
        },
        weights,
        kv,
        {"nb": len(seqs), "blk": block, "pages": 64, "maxp": ps.block_table.shape[1]},
        values,
    )
    # an lm_head read only by its argmax is fused with it (fuse_lm_head_argmax): its logits are never stored
    fused = [n for n, _ in program.propose.nodes_of(Op.LM_HEAD_ARGMAX)]
    assert ("lm_head" in values) == (not fused) and (fused == ["argmax"]) == (name == "tiny-dflash")
    if "lm_head" in values:
        logits, want_logits = values["lm_head"].astype(np.float32), interp.last_values["propose"]["lm_head"]
        # bf16 between kernels (the interpreter keeps f32) drifts the logits by about 1-3 %; a wrong binding is O(1)
        drift = float(np.linalg.norm(logits - want_logits) / np.linalg.norm(want_logits))
        assert drift < 0.05, f"lm_head logits differ from the interpreter by {drift:.3f} (relative norm)"
    got = out["tokens"].reshape(len(seqs), block - 1)
    # bf16 storage between kernels moves near-tie decisions only; a wrong binding scrambles most of them.
    # DSpark and DFlash2 walk: a pick that went the other way changes the rest of its row, the first does not.
    np.testing.assert_array_equal(got[:, 0], want.tokens[:, 0])
    agree = float(np.mean(got == want.tokens))
    assert agree >= 0.75, f"{name}: {agree:.0%} of the drafts agree with the interpreter"
    if want.confidences is not None:
        same_walk = np.cumprod(got == want.tokens, axis=1).astype(bool)  # confidences follow the walk's picks
        conf = out["confidences"].reshape(got.shape)
        np.testing.assert_allclose(conf[same_walk], want.confidences[same_walk], atol=0.05)


@pytest.mark.parametrize(
    ("name", "precision"), [(name, "bf16") for name in TINY] + [("tiny-dflash", "fp8"), ("tiny-dspark", "fp8")]
)
def test_kernel_plans_reproduce_the_reference_over_a_scenario(name, precision, tmp_path):
    """The GPU test's scenario (4 sequences, 20 steps, rollback, free and reuse) with the kernel plans run on
    the CPU: every clear decision equals the f32 reference's (compare.py's near-tie rule); an FP8 build's
    reference computes with the same quantized weights (`as_compiled`)."""
    from plan_runner import PlanDrafter

    from dflash_compiler.checkpoint import write_example
    from dflash_compiler.kernel_build import schedule_program
    from dflash_compiler.options import Precision
    from dflash_compiler.pipeline import optimize
    from dflash_compiler.selfcheck import default_scenario, self_check
    from dflash_compiler.sources import checkpoint_source

    write_example(name, tmp_path, seed=0)
    cfg = load_drafter_config(tmp_path / "drafter")
    tensor = checkpoint_source(cfg, tmp_path / "drafter", tmp_path / "target")
    options = BuildOptions(max_batch=4, max_seq_len=512, max_ctx_rows=64, precision=Precision(precision))
    program = optimize(cfg, options)
    plans, _ = schedule_program(program, SM90)
    drafter = PlanDrafter(program, plans, tensor, num_pages=133, max_seq_len=512)
    precision_maps = {phase: graph.meta["precision"] for phase, graph in program.phases.items()}
    result = self_check(drafter, cfg, tensor, default_scenario(sequences=4, steps=20, seed=0), precision_maps)
    print(f"\n{name}: {result.comparison.summary()}")
    assert result.comparison.ok, "\n".join(result.comparison.mismatches[:10])
    assert result.comparison.compared >= 50, "too few clear decisions for the check to mean much"
