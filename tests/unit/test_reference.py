"""Independent checks of the fp32 numpy reference (dflash_compiler/reference.py).

Nothing here compares the reference with itself: every expected value comes from code written in this file
(plain loops, float64) or from a structural property (masking, causality, cache equivalence, identity
initialisations) that a wrong reference would break.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from dflash_compiler.config import DrafterConfig, Family, LayerAttention, load_drafter_config, parse_drafter_config
from dflash_compiler.protocol import Scenario, ScenarioRun, make_script, run_scenario
from dflash_compiler.reference import (
    BatchedReference,
    Proposal,
    ReferenceDrafter,
    attend,
    rope,
    top_k_candidates,
)
from dflash_compiler.rope import rope_tables
from dflash_compiler.synth import random_drafter_weights, random_target_weights
from dflash_compiler.tensors import expected_drafter_tensors

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = ("tiny-dflash", "tiny-dflash-yarn", "tiny-dflash2", "tiny-dspark")
TOL = {"rtol": 1e-5, "atol": 1e-5}


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def example_raw(name: str) -> dict[str, Any]:
    return load_drafter_config(EXAMPLES / name).raw


def build(cfg: DrafterConfig, seed: int = 0, weights: dict[str, np.ndarray] | None = None) -> ReferenceDrafter:
    target = random_target_weights(cfg, seed + 1000, tied=cfg.tie_word_embeddings)
    w = random_drafter_weights(cfg, seed) if weights is None else weights
    return ReferenceDrafter(cfg, w, target["embed_tokens"], target["lm_head"])


def taps(cfg: DrafterConfig, rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cfg.fc_in_features)).astype(np.float32)


def fresh_with(drafter: ReferenceDrafter, x: np.ndarray, positions: np.ndarray) -> Any:
    cache = drafter.new_cache()
    drafter.append_context(cache, x, positions)
    return cache


def hand_config(
    layer_type: str = "full_attention",
    *,
    window: int | None = None,
    is_causal: bool | None = None,
    arch: str = "DFlashDraftModel",
    extra: dict[str, Any] | None = None,
) -> DrafterConfig:
    """A one-layer drafter small enough to compute by hand: H=8, 2 q heads, 1 kv head, D=4, B=3, V=11."""
    raw: dict[str, Any] = {
        "architectures": [arch],
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "layer_types": [layer_type],
        "num_target_layers": 4,
        "block_size": 3,
        "vocab_size": 11,
        "dflash_config": {
            "mask_token_id": 10,
            "target_layer_ids": [1, 2],
            "output_multiplier": 0.7,
            "final_logit_softcapping": 3.0,
            "input_embedding_scale": 1.5,
            **(extra or {}),
        },
    }
    if window is not None:
        raw["sliding_window"] = window
    if is_causal is not None:
        raw["is_causal"] = is_causal
    return parse_drafter_config(raw)


def hand_forward(
    cfg: DrafterConfig,
    w: dict[str, np.ndarray],
    embed: np.ndarray,
    lm_head: np.ndarray,
    ctx: np.ndarray,
    ctx_pos: np.ndarray,
    anchor: int,
    p0: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The one-layer forward in float64 with explicit loops for RoPE, the mask, attention and the conv."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    H, nh, nkv, D, B, eps = 8, 2, 1, 4, 3, 1e-6
    theta = 10000.0
    lt = cfg.raw["layer_types"][0]
    causal = cfg.raw.get("is_causal", lt == "sliding_attention")
    window = cfg.raw.get("sliding_window") if lt == "sliding_attention" else None

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * g

    def rot(x: np.ndarray, pos: np.ndarray) -> np.ndarray:  # x [n, heads, D]; pair (j, j + D/2)
        out = np.empty_like(x)
        for t in range(x.shape[0]):
            for j in range(D // 2):
                ang = pos[t] * theta ** (-2.0 * j / D)
                a, b = x[t, :, j], x[t, :, j + D // 2]
                out[t, :, j] = a * math.cos(ang) - b * math.sin(ang)
                out[t, :, j + D // 2] = b * math.cos(ang) + a * math.sin(ang)
        return out

    def sees(qp: int, kp: int) -> bool:
        if causal and kp > qp:
            return False
        if window is not None and qp - kp >= window:
            return False
        return not (window is not None and not causal and kp - qp >= window)

    def conv(x: np.ndarray, d: np.ndarray, base: np.ndarray, g: int) -> np.ndarray:
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            for c in range(x.shape[1]):
                for o in range(base.shape[0]):
                    if t - o >= 0:
                        out[t, c] += (base[o, c] + d[t, o, c // g]) * x[t - o, c]
        return out

    def dyn_of(u: np.ndarray, proj: np.ndarray, taps: int, g: int) -> np.ndarray:
        flat = u @ proj.T
        groups = H // g
        d = np.zeros((B, 2, taps, groups))
        for t in range(B):
            for s in range(2):
                for o in range(taps):
                    for grp in range(groups):
                        d[t, s, o, grp] = flat[t, s * taps * groups + o * groups + grp]
        return d

    p = "layers.0."
    c = rms(ctx.astype(np.float64) @ w["fc.weight"].T, w["hidden_norm.weight"])
    ids = [anchor] + [cfg.mask_token_id] * (B - 1)
    h = embed.astype(np.float64)[ids] * 1.5
    pb = p0 + np.arange(B)
    kpos = np.concatenate([ctx_pos, pb])
    dflash2 = cfg.family is Family.DFLASH2

    u = rms(h, w[p + "input_layernorm.weight"])
    if dflash2:
        kk, gg = cfg.raw["dflash_config"]["conv_kernel_size"], cfg.raw["dflash_config"]["conv_group_size"]
        da = dyn_of(u, w[p + "attention_conv.kernel_projection.weight"], kk, gg)
        u = conv(u, da[:, 0], w[p + "attention_conv.base_kernel"][0], gg)
    q = rot(rms((u @ w[p + "self_attn.q_proj.weight"].T).reshape(B, nh, D), w[p + "self_attn.q_norm.weight"]), pb)
    k_all = np.concatenate([c @ w[p + "self_attn.k_proj.weight"].T, u @ w[p + "self_attn.k_proj.weight"].T])
    k_all = rot(rms(k_all.reshape(-1, nkv, D), w[p + "self_attn.k_norm.weight"]), kpos)
    v_all = np.concatenate([c @ w[p + "self_attn.v_proj.weight"].T, u @ w[p + "self_attn.v_proj.weight"].T])
    v_all = v_all.reshape(-1, nkv, D)
    o = np.zeros((B, nh, D))
    for i in range(B):
        for j in range(nh):
            g = j // (nh // nkv)
            s = [q[i, j] @ k_all[n, g] / math.sqrt(D) if sees(pb[i], kpos[n]) else -math.inf for n in range(len(kpos))]
            m = max(s)
            e = [math.exp(x - m) for x in s]
            o[i, j] = sum(e[n] * v_all[n, g] for n in range(len(kpos))) / sum(e)
    a = o.reshape(B, nh * D) @ w[p + "self_attn.o_proj.weight"].T
    if dflash2:
        a = conv(a, da[:, 1], w[p + "attention_conv.base_kernel"][1], gg)
    h = h + a
    m2 = rms(h, w[p + "post_attention_layernorm.weight"])
    if dflash2:
        dm = dyn_of(m2, w[p + "mlp_conv.kernel_projection.weight"], kk, gg)
        m2 = conv(m2, dm[:, 0], w[p + "mlp_conv.base_kernel"][0], gg)
    gate = m2 @ w[p + "mlp.gate_proj.weight"].T
    y = (gate / (1 + np.exp(-gate)) * (m2 @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    if dflash2:
        y = conv(y, dm[:, 1], w[p + "mlp_conv.base_kernel"][1], gg)
    hn = rms(h + y, w["norm.weight"])
    logits = np.tanh(hn[1:] @ lm_head.astype(np.float64).T * 0.7 / 3.0) * 3.0
    return hn, logits


# --------------------------------------------------------------------------------------------------
# attention and RoPE in isolation
# --------------------------------------------------------------------------------------------------

LAYER_VARIANTS = [
    LayerAttention(kind="full_attention", causal=False, window=None),
    LayerAttention(kind="full_attention", causal=True, window=None),
    LayerAttention(kind="sliding_attention", causal=True, window=5),
    LayerAttention(kind="sliding_attention", causal=False, window=3),
]


@pytest.mark.parametrize("layer", LAYER_VARIANTS, ids=lambda x: x.describe())
def test_attention_matches_triple_loop(layer: LayerAttention) -> None:
    rng = np.random.default_rng(7)
    nh, nkv, D, B, p0 = 4, 2, 8, 6, 30
    # Context at scattered positions, shuffled: the mask must follow positions, not storage order.
    ctx_pos = rng.permutation(np.sort(rng.choice(p0, size=12, replace=False)))
    q_pos = p0 + np.arange(B)
    k_pos = np.concatenate([ctx_pos, q_pos])
    q = rng.standard_normal((B, nh, D)).astype(np.float32)
    k = rng.standard_normal((len(k_pos), nkv, D)).astype(np.float32)
    v = rng.standard_normal((len(k_pos), nkv, D)).astype(np.float32)
    W = layer.window

    expected = np.zeros((B, nh, D))
    for i in range(B):
        for j in range(nh):
            kvh = j // (nh // nkv)
            weights: list[float] = []
            for n in range(len(k_pos)):
                qp, kp = int(q_pos[i]), int(k_pos[n])
                ok = True
                if layer.causal and kp > qp:
                    ok = False
                if W is not None and qp - kp >= W:
                    ok = False
                if W is not None and not layer.causal and kp - qp >= W:
                    ok = False
                s = sum(float(q[i, j, d]) * float(k[n, kvh, d]) for d in range(D)) / math.sqrt(D)
                weights.append(s if ok else -math.inf)
            top = max(weights)
            ex = [math.exp(s - top) for s in weights]
            total = sum(ex)
            for d in range(D):
                expected[i, j, d] = sum(ex[n] * float(v[n, kvh, d]) for n in range(len(k_pos))) / total
    got = attend(layer, q, k, v, q_pos, k_pos)
    np.testing.assert_allclose(got, expected, **TOL)


@pytest.mark.parametrize("name", ["tiny-dflash", "tiny-dflash-yarn"])
def test_rope_identity_at_zero_and_pair_norms(name: str) -> None:
    cfg = load_drafter_config(EXAMPLES / name)
    inv_freq, af = rope_tables(cfg.rope, cfg.head_dim)
    if name.endswith("yarn"):
        assert af == pytest.approx(0.1 * math.log(4.0) + 1.0)
    else:
        assert af == 1.0
    D, half = cfg.head_dim, cfg.head_dim // 2
    x = np.random.default_rng(3).standard_normal((5, 3, D)).astype(np.float32)
    np.testing.assert_allclose(rope(x, np.zeros(5, dtype=np.int64), inv_freq, af), x * af, rtol=1e-6)

    pos = np.array([1, 7, 100, 4095, 123456])
    y = rope(x, pos, inv_freq, af)
    pair_in = np.hypot(x[..., :half], x[..., half:])
    pair_out = np.hypot(y[..., :half], y[..., half:])
    np.testing.assert_allclose(pair_out, pair_in * af, rtol=1e-5, atol=1e-6)
    assert not np.allclose(y, x * af)

    # Relative-position property: <rope(q, m), rope(k, n)> depends only on m - n (times af²).
    q, k = x[:1], x[1:2]

    def dot(m: int, n: int) -> float:
        a = rope(q, np.array([m]), inv_freq, af).astype(np.float64)
        b = rope(k, np.array([n]), inv_freq, af).astype(np.float64)
        return float((a * b).sum())

    plain = float((q.astype(np.float64) * k).sum()) * af * af
    assert dot(9, 9) == pytest.approx(plain, rel=1e-5)
    assert dot(50, 20) == pytest.approx(dot(1030, 1000), rel=1e-4, abs=1e-4)


def test_rope_angles_match_theta_formula() -> None:
    cfg = load_drafter_config(EXAMPLES / "tiny-dflash")
    inv_freq, af = rope_tables(cfg.rope, cfg.head_dim)
    D = cfg.head_dim
    x = np.zeros((1, 1, D), dtype=np.float32)
    x[0, 0, 2] = 1.0  # unit vector on the first element of pair j = 2
    y = rope(x, np.array([5]), inv_freq, af)
    ang = 5 * 10000.0 ** (-4.0 / D)
    assert y[0, 0, 2] == pytest.approx(math.cos(ang), abs=1e-6)
    assert y[0, 0, 2 + D // 2] == pytest.approx(math.sin(ang), abs=1e-6)


def test_top_k_order_descending_logit_then_ascending_id() -> None:
    logits = np.array([1.0, 3.0, 2.0, 3.0, -1.0, 2.0, 3.0], dtype=np.float32)
    assert top_k_candidates(logits, 5).tolist() == [1, 3, 6, 2, 5]


# --------------------------------------------------------------------------------------------------
# one layer by hand, every family
# --------------------------------------------------------------------------------------------------

HAND_CASES = {
    "full-noncausal": {},
    "sliding-causal": {"layer_type": "sliding_attention", "window": 4},
    "sliding-symmetric": {"layer_type": "sliding_attention", "window": 2, "is_causal": False},
    "full-causal": {"is_causal": True},
}


def _hand_check(cfg: DrafterConfig, seed: int) -> list[tuple[int, Any, np.ndarray, np.ndarray]]:
    """Run the reference and the hand forward over a few rounds, checking hidden and logits; return
    ``(anchor, proposal, hand hn, hand logits)`` per round for the head checks."""
    w = random_drafter_weights(cfg, seed)
    target = random_target_weights(cfg, seed + 1)
    drafter = ReferenceDrafter(cfg, w, target["embed_tokens"], target["lm_head"])
    cache = drafter.new_cache()
    ctx = taps(cfg, 16, seed)
    out = []
    # Prefill 8 rows in two chunks, then rounds that commit 1..2 rows each.
    drafter.append_context(cache, ctx[:5], np.arange(5))
    drafter.append_context(cache, ctx[5:8], np.arange(5, 8))
    p0, anchors = 8, [3, 7, 0, 9]
    for r, anchor in enumerate(anchors):
        prop = drafter.propose(cache, anchor, p0)
        hn, logits = hand_forward(
            cfg, w, target["embed_tokens"], target["lm_head"], ctx[:p0], np.arange(p0), anchor, p0
        )
        np.testing.assert_allclose(prop.hidden, hn, **TOL)
        np.testing.assert_allclose(prop.logits, logits, **TOL)
        out.append((anchor, prop, hn, logits))
        step = 1 + r % 2
        drafter.append_context(cache, ctx[p0 : p0 + step], np.arange(p0, p0 + step))
        p0 += step
    return out


@pytest.mark.parametrize("case", sorted(HAND_CASES))
def test_one_layer_v1_by_hand(case: str) -> None:
    cfg = hand_config(**HAND_CASES[case])
    for _anchor, prop, _hn, logits in _hand_check(cfg, seed=11):
        assert prop.tokens.dtype == np.int64
        assert prop.tokens.tolist() == np.argmax(logits, axis=-1).tolist()
        assert prop.confidences is None


@pytest.mark.parametrize("with_markov", [True, False])
def test_one_layer_dspark_by_hand(with_markov: bool) -> None:
    extra = {
        "markov_rank": 5,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": with_markov,
        "projector_type": "dspark",
    }
    cfg = hand_config(arch="DSparkDraftModel", extra=extra)
    w = random_drafter_weights(cfg, 21)
    w1, w2 = w["markov_head.markov_w1.weight"].astype(np.float64), w["markov_head.markov_w2.weight"].astype(np.float64)
    cw, cb = w["confidence_head.proj.weight"][0].astype(np.float64), float(w["confidence_head.proj.bias"][0])
    differs = False
    for anchor, prop, hn, logits in _hand_check(cfg, seed=21):
        prev, toks, confs = anchor, [], []
        for i in range(logits.shape[0]):
            e = w1[prev]
            feats = np.concatenate([hn[1 + i], e]) if with_markov else hn[1 + i]
            confs.append(1.0 / (1.0 + math.exp(-(float(cw @ feats) + cb))))
            prev = int(np.argmax(logits[i] + w2 @ e))
            toks.append(prev)
        assert prop.tokens.tolist() == toks
        np.testing.assert_allclose(prop.confidences, confs, **TOL)
        differs |= toks != np.argmax(logits, axis=-1).tolist()
    assert differs, "the Markov bias never changed a token; the check is vacuous"


def test_one_layer_dspark_walk_exact_anchor() -> None:
    """The walk starts from the anchor itself (prev_0 = anchor), checked with a known anchor."""
    extra = {"markov_rank": 5, "enable_confidence_head": True, "projector_type": "dspark"}
    cfg = hand_config(arch="DSparkDraftModel", extra=extra)
    w = random_drafter_weights(cfg, 5)
    target = random_target_weights(cfg, 6)
    drafter = ReferenceDrafter(cfg, w, target["embed_tokens"], target["lm_head"])
    cache = fresh_with(drafter, taps(cfg, 6, 1), np.arange(6))
    w1, w2 = w["markov_head.markov_w1.weight"].astype(np.float64), w["markov_head.markov_w2.weight"].astype(np.float64)
    for anchor in range(cfg.vocab_size):
        prop = drafter.propose(cache, anchor, 6)
        first = int(np.argmax(prop.logits[0] + w2 @ w1[anchor]))
        assert prop.tokens[0] == first
        second = int(np.argmax(prop.logits[1] + w2 @ w1[first]))
        assert prop.tokens[1] == second


def _dflash2_hand() -> tuple[DrafterConfig, np.ndarray, np.ndarray, np.ndarray]:
    """A one-layer DFlash2 (rank-3 selector over 4 candidates) and its selector's P, A and Bc (seed 31)."""
    extra = {"conv_kernel_size": 2, "conv_group_size": 4, "selector_rank": 3, "selector_top_k": 4}
    cfg = hand_config("sliding_attention", window=6, is_causal=False, arch="DFlash2DraftModel", extra=extra)
    w = random_drafter_weights(cfg, 31)
    P = w["candidate_selector.hidden_projection.weight"].astype(np.float64)
    A = w["candidate_selector.predecessor_codebook"].astype(np.float64)
    Bc = w["candidate_selector.successor_codebook"].astype(np.float64)
    return cfg, P, A, Bc


def test_one_layer_dflash2_by_hand() -> None:
    cfg, P, A, Bc = _dflash2_hand()
    differs = False
    for anchor, prop, hn, logits in _hand_check(cfg, seed=31):
        pred, toks = anchor, []
        for i in range(logits.shape[0]):
            cand = sorted(range(cfg.vocab_size), key=lambda t, i=i: (-logits[i, t], t))[:4]
            hp = P @ hn[1 + i]
            scores = [logits[i, c] + sum(A[pred, j] * hp[j] * Bc[c, j] for j in range(3)) for c in cand]
            pred = cand[int(np.argmax(scores))]
            toks.append(pred)
            np.testing.assert_allclose(prop.decision_scores[i], scores, **TOL)
            assert prop.candidates[i].tolist() == cand
        assert prop.tokens.tolist() == toks
        differs |= toks != np.argmax(logits, axis=-1).tolist()
    assert differs, "the selector never overrode the argmax; the check is vacuous"


def test_dflash2_gap_noise_is_the_selector_gaps_spread_under_hidden_state_noise() -> None:
    """Push each row's hidden state by 1 % of its norm in random directions, recompute the selector term of
    the top-2 gap by hand, and compare the spread of its change with ``gap_noise`` x 1 %."""
    cfg, P, A, Bc = _dflash2_hand()
    rng = np.random.default_rng(5)
    for anchor, prop, hn, _logits in _hand_check(cfg, seed=31):
        preds = [anchor, *prop.tokens[:-1].tolist()]
        for i, pred in enumerate(preds):
            order = np.argsort(-prop.decision_scores[i], kind="stable")
            best, second = prop.candidates[i][order[0]], prop.candidates[i][order[1]]
            h = hn[1 + i]

            def term(x: np.ndarray, pred: int = pred, best: int = best, second: int = second) -> float:
                return float(sum(A[pred, j] * (P[j] @ x) * (Bc[best, j] - Bc[second, j]) for j in range(3)))

            dirs = rng.standard_normal((4000, h.size))
            dirs *= 0.01 * np.linalg.norm(h) / np.linalg.norm(dirs, axis=1, keepdims=True)
            moved = np.array([term(h + d) for d in dirs]) - term(h)
            assert math.isclose(float(np.std(moved)), 0.01 * float(prop.gap_noise[i]), rel_tol=0.06)


# --------------------------------------------------------------------------------------------------
# the step protocol: incremental cache == recompute, padded mode == exact mode
# --------------------------------------------------------------------------------------------------


def protocol(drafter: ReferenceDrafter, prompts: tuple[int, ...], steps: int, seed: int, **kw: Any) -> ScenarioRun:
    """The shared multi-step protocol driven against the reference (through its batched adapter)."""
    scenario = Scenario(prompt_lengths=prompts, steps=steps, seed=seed, **{"padded_every": 0, "replace_at": None} | kw)
    return run_scenario(BatchedReference(drafter), drafter.cfg, scenario)


def proposals(run: ScenarioRun) -> list[tuple[int, int, Proposal]]:
    """(sequence id, scenario round, proposal) for every proposal of the run."""
    return [(s, r.step, p) for r in run.records for s, p in zip(r.seq_ids, r.drafts.proposals, strict=True)]


@pytest.mark.parametrize("name", TINY)
def test_cache_equals_recompute_over_protocol(name: str) -> None:
    cfg = load_drafter_config(EXAMPLES / name)
    drafter = build(cfg, seed=3)
    run = protocol(drafter, (3, 11, 20), steps=10, seed=5, replace_at=4)
    assert len(run.records) == 10 and len(run.scripts) == 4
    accepted = {s.accepted for script in run.scripts.values() for s in script.steps}
    assert len(accepted) > 3, "the script should accept varied prefixes"
    for seq, step, prop in proposals(run):
        script_step = run.script_step(seq, step)
        ctx, pos = run.scripts[seq].context_before(script_step)
        p0, anchor = run.scripts[seq].steps[script_step].p0, run.scripts[seq].steps[script_step].anchor
        assert p0 == pos.max() + 1 == len(pos)
        again = drafter.propose(fresh_with(drafter, ctx, pos), anchor, p0)
        assert again.tokens.tolist() == prop.tokens.tolist()
        np.testing.assert_allclose(prop.hidden, again.hidden, **TOL)
        np.testing.assert_allclose(prop.logits, again.logits, **TOL)
        if cfg.family is Family.DSPARK:
            np.testing.assert_allclose(prop.confidences, again.confidences, **TOL)
    # Padded mode (append every verified row, then roll the rejected ones back) must agree exactly.
    padded = protocol(drafter, (3, 11, 20), steps=10, seed=5, replace_at=4, padded_every=1)
    for (_, _, a), (_, _, b) in zip(proposals(run), proposals(padded), strict=True):
        assert a.tokens.tolist() == b.tokens.tolist()
        np.testing.assert_allclose(a.hidden, b.hidden, **TOL)


def test_protocol_depends_on_context() -> None:
    """Guard against a vacuous cache test: the proposals really depend on the cached context."""
    cfg = load_drafter_config(EXAMPLES / "tiny-dflash")
    drafter = build(cfg, seed=3)
    ctx, pos = make_script(cfg, 20, 3, seed=5).context_before(2)
    base = drafter.propose(fresh_with(drafter, ctx, pos), 17, int(pos.max()) + 1)
    other = drafter.propose(fresh_with(drafter, ctx[::-1].copy(), pos), 17, int(pos.max()) + 1)
    assert np.abs(base.hidden - other.hidden).max() > 1e-3


def test_stale_rows_are_refused() -> None:
    cfg = load_drafter_config(EXAMPLES / "tiny-dflash")
    drafter = build(cfg)
    cache = fresh_with(drafter, taps(cfg, 6, 0), np.arange(6))
    with pytest.raises(ValueError, match="already cached"):
        drafter.append_context(cache, taps(cfg, 1, 1), np.array([3]))
    with pytest.raises(ValueError, match="roll back"):
        drafter.propose(cache, 1, 4)


def test_rollback_then_reappend_equals_never_appended() -> None:
    cfg = load_drafter_config(EXAMPLES / "tiny-dflash")
    drafter = build(cfg, seed=9)
    ctx, junk = taps(cfg, 14, 1), taps(cfg, 6, 2)
    clean = fresh_with(drafter, ctx[:10], np.arange(10))
    drafter.append_context(clean, ctx[10:13], np.arange(10, 13))

    dirty = fresh_with(drafter, ctx[:10], np.arange(10))
    drafter.append_context(dirty, junk, np.arange(10, 16))
    drafter.rollback(dirty, 12)
    assert dirty.positions.tolist() == list(range(12))
    drafter.rollback(dirty, 10)
    drafter.append_context(dirty, ctx[10:13], np.arange(10, 13))

    np.testing.assert_array_equal(clean.positions, dirty.positions)
    for layer in range(cfg.num_layers):
        np.testing.assert_array_equal(clean.keys[layer], dirty.keys[layer])
        np.testing.assert_array_equal(clean.values[layer], dirty.values[layer])
    a, b = drafter.propose(clean, 42, 13), drafter.propose(dirty, 42, 13)
    assert a.tokens.tolist() == b.tokens.tolist()
    np.testing.assert_array_equal(a.hidden, b.hidden)
    # ... and the junk rows, had they stayed, would have changed the proposal.
    kept = fresh_with(drafter, ctx[:10], np.arange(10))
    drafter.append_context(kept, junk[:3], np.arange(10, 13))
    assert np.abs(drafter.propose(kept, 42, 13).hidden - a.hidden).max() > 1e-3


# --------------------------------------------------------------------------------------------------
# masks seen through the whole drafter
# --------------------------------------------------------------------------------------------------


def _with(raw: dict[str, Any], **changes: Any) -> DrafterConfig:
    raw = copy.deepcopy(raw)
    dflash = changes.pop("dflash_config", None)
    raw.update(changes)
    if dflash:
        raw["dflash_config"].update(dflash)
    return parse_drafter_config(raw)


@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window_hides_old_keys(causal: bool, layers: int) -> None:
    raw = example_raw("tiny-dflash")
    cfg = _with(raw, num_hidden_layers=layers, layer_types=["sliding_attention"] * layers, is_causal=causal)
    W, p0 = cfg.layers[0].window, 30
    assert W == 12
    drafter = build(cfg, seed=4)
    ctx = taps(cfg, p0, 8)
    base = drafter.propose(fresh_with(drafter, ctx, np.arange(p0)), 5, p0)

    outside = ctx.copy()
    outside[: p0 - W + 1] = taps(cfg, p0 - W + 1, 99)  # positions <= p0 - W: seen by no block row
    moved = drafter.propose(fresh_with(drafter, outside, np.arange(p0)), 5, p0)
    np.testing.assert_allclose(moved.hidden, base.hidden, rtol=1e-6, atol=1e-7)
    assert moved.tokens.tolist() == base.tokens.tolist()

    inside = ctx.copy()
    inside[p0 - W + 1] = taps(cfg, 1, 98)[0]  # in the window of block row 0 (and, non-causal, of no other)
    moved = drafter.propose(fresh_with(drafter, inside, np.arange(p0)), 5, p0)
    assert np.abs(moved.hidden[0] - base.hidden[0]).max() > 1e-4
    if layers == 1:
        # One layer: only row 0 reads that key. (Deeper, row 0's change reaches later rows through the
        # block K/V of the next layer, causal or not.)
        np.testing.assert_allclose(moved.hidden[1:], base.hidden[1:], rtol=1e-6, atol=1e-7)


def _influence(drafter: ReferenceDrafter, row: int, seed: int = 0) -> np.ndarray:
    """Max change of each block row's output when the input of block row ``row`` is perturbed."""
    cfg = drafter.cfg
    cache = fresh_with(drafter, taps(cfg, 9, seed), np.arange(9))
    x = drafter.embed_block(7)
    y = x.copy()
    y[row] += np.random.default_rng(seed + 1).standard_normal(cfg.hidden_size).astype(np.float32)
    return np.abs(drafter.block_hidden(cache, y, 9) - drafter.block_hidden(cache, x, 9)).max(axis=-1)


@pytest.mark.parametrize("name", TINY)
def test_causal_layers_hide_later_rows(name: str) -> None:
    cfg = _with(example_raw(name), is_causal=True)
    assert all(layer.causal for layer in cfg.layers)
    change = _influence(build(cfg, seed=2), row=4)
    assert (change[:4] == 0).all(), change
    assert (change[4:] > 1e-4).all(), change


@pytest.mark.parametrize("name", TINY)
def test_noncausal_layers_see_later_rows(name: str) -> None:
    cfg = load_drafter_config(EXAMPLES / name)
    assert not cfg.layers[-1].causal
    change = _influence(build(cfg, seed=2), row=cfg.block_size - 1)
    assert (change > 1e-4).all(), change


def test_symmetric_window_inside_block() -> None:
    """A non-causal sliding layer with W < B: row t sees block row j only when |t - j| < W."""
    raw = example_raw("tiny-dflash")
    cfg = _with(raw, num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=3, is_causal=False)
    change = _influence(build(cfg, seed=6), row=6)
    assert cfg.block_size == 8
    assert (change[:4] == 0).all(), change
    assert (change[4:] > 1e-4).all(), change


# --------------------------------------------------------------------------------------------------
# family heads reduce to v1 at their identity initialisations
# --------------------------------------------------------------------------------------------------


def _as_v1(raw: dict[str, Any]) -> DrafterConfig:
    raw = copy.deepcopy(raw)
    raw["architectures"] = ["DFlashDraftModel"]
    for key in (
        "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "projector_type",
        "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
        "confidence_head_alpha", "attention_mode",
    ):  # fmt: skip
        raw["dflash_config"].pop(key, None)
    raw["block_size"] = raw["dflash_config"].pop("block_size", raw.get("block_size"))
    return parse_drafter_config(raw)


def _pair(name: str, seed: int, edit: Any) -> tuple[ReferenceDrafter, ReferenceDrafter]:
    cfg = load_drafter_config(EXAMPLES / name)
    v1 = _as_v1(cfg.raw)
    w = random_drafter_weights(cfg, seed)
    edit(w)
    target = random_target_weights(cfg, seed + 1)
    family = ReferenceDrafter(cfg, w, target["embed_tokens"], target["lm_head"])
    names = expected_drafter_tensors(v1)
    plain = ReferenceDrafter(v1, {k: w[k] for k in names}, target["embed_tokens"], target["lm_head"])
    assert plain.cfg.family is Family.DFLASH and plain.cfg.block_size == cfg.block_size
    return family, plain


def _identity_conv(w: dict[str, np.ndarray]) -> None:
    for name in w:
        if name.endswith("base_kernel"):
            w[name] = np.zeros_like(w[name])
            w[name][:, 0, :] = 1.0
        if name.endswith("kernel_projection.weight"):
            w[name] = np.zeros_like(w[name])


def _zero_codebooks(w: dict[str, np.ndarray]) -> None:
    for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
        w[name] = np.zeros_like(w[name])


def _compare_runs(a: ReferenceDrafter, b: ReferenceDrafter, tokens: bool) -> None:
    ra, rb = protocol(a, (4, 15), steps=4, seed=2), protocol(b, (4, 15), steps=4, seed=2)
    for (_, _, x), (_, _, y) in zip(proposals(ra), proposals(rb), strict=True):
        np.testing.assert_allclose(x.hidden, y.hidden, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(x.logits, y.logits, rtol=1e-6, atol=1e-6)
        if tokens:
            assert x.tokens.tolist() == y.tokens.tolist()


def test_dflash2_identity_conv_equals_v1() -> None:
    dflash2, v1 = _pair("tiny-dflash2", 4, _identity_conv)
    _compare_runs(dflash2, v1, tokens=False)
    # With the random (non-identity) conv the backbone differs: the conv is really wired in.
    cfg = dflash2.cfg
    target = random_target_weights(cfg, 5)
    live = ReferenceDrafter(cfg, random_drafter_weights(cfg, 4), target["embed_tokens"], target["lm_head"])
    ctx = taps(cfg, 5, 0)
    live_hidden = live.propose(fresh_with(live, ctx, np.arange(5)), 3, 5).hidden
    v1_hidden = v1.propose(fresh_with(v1, ctx, np.arange(5)), 3, 5).hidden
    assert np.abs(live_hidden - v1_hidden).max() > 1e-3


def test_dflash2_zero_codebooks_pick_the_argmax() -> None:
    def edit(w: dict[str, np.ndarray]) -> None:
        _identity_conv(w)
        _zero_codebooks(w)

    dflash2, v1 = _pair("tiny-dflash2", 7, edit)
    _compare_runs(dflash2, v1, tokens=True)
    for _, _, prop in proposals(protocol(dflash2, (6,), steps=3, seed=1)):
        assert prop.tokens.tolist() == np.argmax(prop.logits, axis=-1).tolist()


def test_dspark_zero_w2_is_plain_argmax() -> None:
    def edit(w: dict[str, np.ndarray]) -> None:
        w["markov_head.markov_w2.weight"] = np.zeros_like(w["markov_head.markov_w2.weight"])

    dspark, v1 = _pair("tiny-dspark", 8, edit)
    _compare_runs(dspark, v1, tokens=True)
    for _, _, prop in proposals(protocol(dspark, (6, 9), steps=3, seed=1)):
        assert prop.tokens.tolist() == np.argmax(prop.logits, axis=-1).tolist()
        conf = prop.confidences
        assert conf is not None and conf.shape == (dspark.cfg.gamma,) and ((conf > 0) & (conf < 1)).all()


# --------------------------------------------------------------------------------------------------
# weight handling
# --------------------------------------------------------------------------------------------------


def test_bf16_weights_are_cast_once() -> None:
    cfg = load_drafter_config(EXAMPLES / "tiny-dspark")
    w = random_drafter_weights(cfg, 1)
    target = random_target_weights(cfg, 2)
    bf = {k: v.astype(ml_dtypes.bfloat16) for k, v in w.items()}
    rounded = {k: v.astype(np.float32) for k, v in bf.items()}
    a = ReferenceDrafter(cfg, bf, target["embed_tokens"].astype(ml_dtypes.bfloat16), target["lm_head"])
    b = ReferenceDrafter(
        cfg, rounded, target["embed_tokens"].astype(ml_dtypes.bfloat16).astype(np.float32), target["lm_head"]
    )
    ctx = taps(cfg, 7, 3)
    pa = a.propose(fresh_with(a, ctx, np.arange(7)), 4, 7)
    pb = b.propose(fresh_with(b, ctx, np.arange(7)), 4, 7)
    assert pa.hidden.dtype == np.float32
    np.testing.assert_array_equal(pa.hidden, pb.hidden)
    assert pa.tokens.tolist() == pb.tokens.tolist()


def test_missing_or_misshapen_weights_are_reported() -> None:
    from dflash_compiler.errors import WeightsError

    cfg = load_drafter_config(EXAMPLES / "tiny-dflash")
    w = random_drafter_weights(cfg, 1)
    target = random_target_weights(cfg, 2)
    del w["norm.weight"]
    w["fc.weight"] = w["fc.weight"][:, :-1]
    with pytest.raises(WeightsError) as err:
        ReferenceDrafter(cfg, w, target["embed_tokens"], target["lm_head"])
    assert {p.where for p in err.value.problems} == {"norm.weight", "fc.weight"}


def test_batched_adapter_matches_per_cache_calls() -> None:
    cfg = load_drafter_config(EXAMPLES / "tiny-dspark")
    drafter = build(cfg, seed=12)
    batched = BatchedReference(drafter)
    a, b = taps(cfg, 9, 1), taps(cfg, 4, 2)
    for seq_id in (7, 3):
        batched.create(seq_id)
    batched.append_context([7, 3], [a, b], [np.arange(9), np.arange(4)])
    batched.append_context([3], [taps(cfg, 5, 3)], [np.arange(4, 9)])
    batched.rollback(3, 6)
    assert (batched.length(7), batched.length(3)) == (9, 6)
    drafts = batched.propose([7, 3], [11, 12])
    assert drafts.tokens.shape == (2, cfg.gamma) and drafts.confidences is not None
    direct_7 = drafter.propose(fresh_with(drafter, a, np.arange(9)), 11, 9)
    direct_3 = fresh_with(drafter, b, np.arange(4))
    drafter.append_context(direct_3, taps(cfg, 5, 3)[:2], np.arange(4, 6))
    direct = [direct_7, drafter.propose(direct_3, 12, 6)]
    assert drafts.tokens.tolist() == [d.tokens.tolist() for d in direct]
    np.testing.assert_allclose(drafts.confidences, np.stack([d.confidences for d in direct]), rtol=1e-6)
    batched.free(7)
    assert list(batched.caches) == [3]
