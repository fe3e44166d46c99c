"""The fp32 numpy oracle for DFlash v1, DFlash2 and DSpark drafters (DFLASH.md §1, §2, §4).

Every compiled path is compared against this module, so it favours being obviously right over being
fast: plain fp32 numpy, one small function per piece of math, no fused shortcuts. The pieces are
public so tests (and later kernel tests) can check them one at a time:

* :func:`rms_norm`, :func:`rope`, :func:`attention_visibility`, :func:`attention`, :func:`dynamic_conv`,
  :func:`top_k_candidates` — the math of one op each;
* :class:`ReferenceDrafter` — the drafter: context K/V into a per-sequence :class:`ContextCache`, then
  ``propose`` runs the block ``[anchor, MASK × (B-1)]`` and the family's token head;
* :class:`BatchedReference` — the same drafter behind the batched seq-id surface that
  :func:`dflash_compiler.protocol.run_scenario` drives (the multi-step protocol of §2), like every
  compiled path.

Conventions: weights are keyed by checkpoint tensor names (:func:`~dflash_compiler.tensors.expected_drafter_tensors`)
and cast to float32 once; activations stay float32 throughout. Positions are absolute token positions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_compiler.config import DrafterConfig, Family, LayerAttention
from dflash_compiler.errors import Problem, WeightsError
from dflash_compiler.rope import apply_rope, cos_sin, rope_tables
from dflash_compiler.tensors import expected_drafter_tensors, layer_prefix

F32 = np.float32

__all__ = [
    "BatchedDrafts",
    "BatchedReference",
    "ContextCache",
    "ConvWeights",
    "LayerWeights",
    "Proposal",
    "ReferenceDrafter",
    "attend",
    "attention",
    "attention_visibility",
    "dynamic_conv",
    "rms_norm",
    "rope",
    "silu",
    "to_f32",
    "top_k_candidates",
]


# --------------------------------------------------------------------------------------------------
# Elementary ops
# --------------------------------------------------------------------------------------------------


def to_f32(x: Any) -> np.ndarray:
    """A contiguous float32 copy of any float array (fp32/fp16/bf16/fp8 via ml_dtypes).

    Integer, bool and complex inputs are refused: a weight or activation in one of those is a bug upstream,
    and silently casting it would hide it.
    """
    arr = np.asarray(x)
    if arr.dtype.kind in "biucOSU":
        raise TypeError(f"expected a floating-point array, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr.astype(F32))


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Plain HF Qwen3 RMSNorm over the last axis, ``x / sqrt(mean(x²) + eps) * w``, in fp32.

    The weight multiplies directly (not ``1 + w``), which is what every DFlash-family checkpoint uses.
    """
    x = x.astype(F32, copy=False)
    mean_sq = np.mean(x * x, axis=-1, keepdims=True, dtype=F32)
    return (x / np.sqrt(mean_sq + F32(eps)) * weight).astype(F32, copy=False)


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)``, written as ``x / (1 + exp(-x))`` (overflow to inf gives the right limit 0)."""
    with np.errstate(over="ignore"):
        return (x / (F32(1.0) + np.exp(-x))).astype(F32, copy=False)


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, attention_factor: float) -> np.ndarray:
    """Neox rotate-half RoPE over the full head_dim at absolute ``positions``; ``x [T, heads, D]``.

    cos/sin come from :func:`dflash_compiler.rope.cos_sin` (float64 angles, scaled by YaRN's
    attention_factor) and are rounded to fp32 before use, as a kernel holding fp32 tables would.
    """
    cos, sin = cos_sin(np.asarray(positions, dtype=np.int64), inv_freq, attention_factor)
    return apply_rope(x.astype(F32, copy=False), cos.astype(F32), sin.astype(F32)).astype(F32, copy=False)


def attention_visibility(layer: LayerAttention, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
    """Boolean ``[Q, N]``: may the query at ``q_pos[i]`` see the key at ``k_pos[j]`` (DFLASH.md §1.4)?

    ``visible = (causal ? k <= q : true) & (W is None or (q - k < W and (causal or k - q < W)))`` — a
    one-sided window for causal layers, a symmetric one for non-causal sliding layers. Positions are
    absolute, so cached context rows and block rows are treated alike whatever their order in memory.
    """
    q = np.asarray(q_pos, dtype=np.int64)[:, None]
    k = np.asarray(k_pos, dtype=np.int64)[None, :]
    visible = np.ones((q.shape[0], k.shape[1]), dtype=bool)
    if layer.causal:
        visible &= k <= q
    if layer.window is not None:
        visible &= (q - k) < layer.window
        if not layer.causal:
            visible &= (k - q) < layer.window
    return visible


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Masked softmax attention with GQA: ``q [Q, Hq, D]``, ``k, v [N, Hkv, D]``, ``visible [Q, N]``.

    Query head ``j`` reads kv head ``j // (Hq / Hkv)``; the scale is ``D^-0.5``. A query that sees no key
    at all is an error (the mask logic upstream is wrong), never a silent NaN.
    """
    _, heads, dim = q.shape
    kv_heads = k.shape[1]
    if heads % kv_heads != 0:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} kv heads")
    if not visible.any(axis=1).all():
        raise ValueError("a query row sees no key; check the positions and the layer's mask")
    kv_of_head = np.arange(heads) // (heads // kv_heads)
    keys = k[:, kv_of_head]  # [N, Hq, D]
    values = v[:, kv_of_head]
    scores = np.einsum("qhd,nhd->hqn", q, keys).astype(F32) * F32(dim**-0.5)
    scores = np.where(visible[None], scores, F32(-np.inf))
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hqn,nhd->qhd", probs, values).astype(F32, copy=False)


def attend(
    layer: LayerAttention,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
) -> np.ndarray:
    """One layer's attention: the layer's mask from absolute positions, then :func:`attention`."""
    return attention(q, k, v, attention_visibility(layer, q_pos, k_pos))


def dynamic_conv(x: np.ndarray, dyn: np.ndarray, base: np.ndarray, group_size: int) -> np.ndarray:
    """DFlash2's grouped dynamic causal conv over the block rows (DFLASH.md §4).

    ``out[t, c] = Σ_{o<K} (base[o, c] + dyn[t, o, c // g]) · x[t - o, c]`` with zero padding before row 0,
    so the taps never reach across the block start. ``x [B, H]``, ``dyn [B, K, H/g]``, ``base [K, H]``.
    """
    rows, hidden = x.shape
    taps = base.shape[0]
    per_channel = np.repeat(dyn, group_size, axis=-1)  # [B, K, H]: group c // g broadcast to channel c
    coeff = base[None, :, :] + per_channel  # [B, K, H]
    out = coeff[:, 0] * x
    for o in range(1, min(taps, rows)):
        out[o:] += coeff[o:, o] * x[:-o]
    assert out.shape == (rows, hidden)
    return out.astype(F32, copy=False)


def top_k_candidates(logits: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` ids of largest logit, by descending logit then ascending id (a stable sort of ``-logits``)."""
    return np.argsort(-logits, kind="stable")[:k].astype(np.int64)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Logistic function in fp32; DSpark turns the confidence logit into an acceptance estimate with it."""
    return (F32(1.0) / (F32(1.0) + np.exp(-x.astype(F32)))).astype(F32, copy=False)


# --------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvWeights:
    """One DFlash2 conv wrapper: ``base [2, K, H]`` (input side, output side) and ``projection [2·K·H/g, H]``."""

    base: np.ndarray
    projection: np.ndarray


@dataclass(frozen=True)
class LayerWeights:
    input_norm: np.ndarray
    post_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    attention_conv: ConvWeights | None
    mlp_conv: ConvWeights | None


def _checked_weights(cfg: DrafterConfig, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every tensor the config requires, shape-checked and cast to fp32; extra tensors are ignored."""
    problems: list[Problem] = []
    out: dict[str, np.ndarray] = {}
    for name, spec in expected_drafter_tensors(cfg).items():
        if name not in weights:
            problems.append(Problem(name, "nothing", f"a tensor of shape {list(spec.shape)}", "pass it"))
            continue
        arr = np.asarray(weights[name])
        if tuple(arr.shape) != spec.shape:
            problems.append(Problem(name, f"shape {list(arr.shape)}", f"shape {list(spec.shape)}", "check the config"))
            continue
        try:
            out[name] = to_f32(arr)
        except TypeError as err:
            problems.append(Problem(name, str(arr.dtype), "a floating-point dtype", str(err)))
    if problems:
        raise WeightsError("reference drafter weights", problems)
    return out


# --------------------------------------------------------------------------------------------------
# Cache and outputs
# --------------------------------------------------------------------------------------------------


@dataclass
class ContextCache:
    """One sequence's context K/V: per layer ``K, V [n, Hkv, D]`` plus the rows' absolute ``positions [n]``.

    Only context rows live here (block K/V is never cached, DFLASH.md §2). K is stored after k_norm and
    RoPE, exactly what the attention reads. Rows keep the order they were appended in; the positions,
    not the row order, decide the mask.
    """

    keys: list[np.ndarray]
    values: list[np.ndarray]
    positions: np.ndarray

    @property
    def length(self) -> int:
        return int(self.positions.shape[0])


@dataclass(frozen=True)
class Proposal:
    """What one propose step returns.

    * ``tokens`` int64 ``[B-1]`` — the drafts for positions ``p0+1 .. p0+B-1``;
    * ``confidences`` ``[B-1]`` or None — DSpark's sigmoid acceptance estimate per draft;
    * ``logits`` ``[B-1, V]`` — target-head logits after output_multiplier/softcap, before any Markov bias;
    * ``hidden`` ``[B, H]`` — final-normed hidden states of all block rows (row 0 is the anchor);
    * ``decision_scores`` — what the greedy pick took the argmax of, per draft row: the logits (v1), the
      Markov-biased logits ``[B-1, V]`` (DSpark) or the selector scores ``[B-1, top_k]`` (DFlash2). Compiled
      paths use it to tell a real mismatch from a near-tie;
    * ``candidates`` ``[B-1, top_k]`` or None — DFlash2's candidate ids, in the order of ``decision_scores``;
    * ``gap_noise`` ``[B-1]`` or None — DFlash2: how far the selector term of the top-2 score gap moves, one
      standard deviation, when the row's hidden state carries an error of its own norm in a random direction
      (``‖h‖·‖∂gap/∂h‖/√H``). The codebooks can make that term far steeper than the scores' spread shows.
    """

    tokens: np.ndarray
    confidences: np.ndarray | None
    logits: np.ndarray
    hidden: np.ndarray
    decision_scores: np.ndarray | None = None
    candidates: np.ndarray | None = None
    gap_noise: np.ndarray | None = None


# --------------------------------------------------------------------------------------------------
# The drafter
# --------------------------------------------------------------------------------------------------


class ReferenceDrafter:
    """The fp32 reference forward of one drafter (v1, DFlash2 or DSpark per ``cfg.family``)."""

    def __init__(
        self,
        cfg: DrafterConfig,
        weights: Mapping[str, np.ndarray],
        embed_tokens: np.ndarray,
        lm_head: np.ndarray,
    ) -> None:
        self.cfg = cfg
        w = _checked_weights(cfg, weights)
        table_shape = (cfg.vocab_size, cfg.hidden_size)
        for name, table in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if tuple(np.shape(table)) != table_shape:
                raise WeightsError(
                    "reference drafter target tensors",
                    [Problem(name, f"shape {list(np.shape(table))}", f"shape {list(table_shape)}", "check it")],
                )
        self.embed_tokens = to_f32(embed_tokens)
        self.lm_head = to_f32(lm_head)
        self.fc = w["fc.weight"]
        self.hidden_norm = w["hidden_norm.weight"]
        self.final_norm = w["norm.weight"]
        self.layers = tuple(self._layer_weights(w, i) for i in range(cfg.num_layers))
        self.inv_freq, self.attention_factor = rope_tables(cfg.rope, cfg.head_dim)
        self.eps = cfg.rms_norm_eps
        self.selector: dict[str, np.ndarray] = {}
        if cfg.family is Family.DFLASH2:
            self.selector = {
                "hidden_projection": w["candidate_selector.hidden_projection.weight"],
                "predecessor": w["candidate_selector.predecessor_codebook"],
                "successor": w["candidate_selector.successor_codebook"],
            }
        self.markov: dict[str, np.ndarray] = {}
        if cfg.family is Family.DSPARK:
            self.markov = {"w1": w["markov_head.markov_w1.weight"], "w2": w["markov_head.markov_w2.weight"]}
            assert cfg.dspark is not None
            if cfg.dspark.enable_confidence_head:
                self.markov["conf_w"] = w["confidence_head.proj.weight"][0]
                self.markov["conf_b"] = w["confidence_head.proj.bias"]

    def _layer_weights(self, w: Mapping[str, np.ndarray], i: int) -> LayerWeights:
        p = layer_prefix(i)
        convs: dict[str, ConvWeights | None] = {"attention_conv": None, "mlp_conv": None}
        if self.cfg.family is Family.DFLASH2:
            for conv in convs:
                convs[conv] = ConvWeights(w[p + f"{conv}.base_kernel"], w[p + f"{conv}.kernel_projection.weight"])
        return LayerWeights(
            input_norm=w[p + "input_layernorm.weight"],
            post_norm=w[p + "post_attention_layernorm.weight"],
            wq=w[p + "self_attn.q_proj.weight"],
            wk=w[p + "self_attn.k_proj.weight"],
            wv=w[p + "self_attn.v_proj.weight"],
            wo=w[p + "self_attn.o_proj.weight"],
            q_norm=w[p + "self_attn.q_norm.weight"],
            k_norm=w[p + "self_attn.k_norm.weight"],
            w_gate=w[p + "mlp.gate_proj.weight"],
            w_up=w[p + "mlp.up_proj.weight"],
            w_down=w[p + "mlp.down_proj.weight"],
            attention_conv=convs["attention_conv"],
            mlp_conv=convs["mlp_conv"],
        )

    # ---- context cache ---------------------------------------------------------------------------

    def new_cache(self) -> ContextCache:
        cfg = self.cfg
        empty = np.zeros((0, cfg.num_kv_heads, cfg.head_dim), dtype=F32)
        return ContextCache(
            keys=[empty.copy() for _ in range(cfg.num_layers)],
            values=[empty.copy() for _ in range(cfg.num_layers)],
            positions=np.zeros((0,), dtype=np.int64),
        )

    def context_kv(self, taps: np.ndarray, positions: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer ``(K, V)`` of new context rows: ``c = RMSNorm_hidden(taps @ fc.T)`` shared by all layers,
        then each layer's own k_proj → k_norm → RoPE and v_proj (no input norm, no query, no MLP)."""
        cfg = self.cfg
        taps = to_f32(taps)
        if taps.ndim != 2 or taps.shape[1] != cfg.fc_in_features:
            raise ValueError(f"taps must be [C, {cfg.fc_in_features}], got {list(taps.shape)}")
        c = rms_norm(taps @ self.fc.T, self.hidden_norm, self.eps)
        rows = c.shape[0]
        out = []
        for lw in self.layers:
            k = rms_norm((c @ lw.wk.T).reshape(rows, cfg.num_kv_heads, cfg.head_dim), lw.k_norm, self.eps)
            k = rope(k, positions, self.inv_freq, self.attention_factor)
            v = (c @ lw.wv.T).reshape(rows, cfg.num_kv_heads, cfg.head_dim).astype(F32, copy=False)
            out.append((k, v))
        return out

    def append_context(self, cache: ContextCache, taps: np.ndarray, positions: np.ndarray) -> None:
        """Append context rows (the target's taps ``[C, T·H_t]``) at absolute ``positions [C]``.

        A position may be cached once: re-appending a cached position is refused, so a caller that wants
        to overwrite (vLLM's padded mode writes rejected rows, then the next step's rows land on the same
        slots) must :meth:`rollback` first. That keeps a stale row from ever being read silently.
        """
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if positions.shape[0] != np.shape(taps)[0]:
            raise ValueError(f"{np.shape(taps)[0]} tap rows but {positions.shape[0]} positions")
        if (positions < 0).any():
            raise ValueError("positions must be >= 0")
        if np.unique(positions).shape[0] != positions.shape[0] or np.isin(positions, cache.positions).any():
            raise ValueError("a context position is already cached (or repeated); roll back before re-appending")
        for layer, (k, v) in enumerate(self.context_kv(taps, positions)):
            cache.keys[layer] = np.concatenate([cache.keys[layer], k])
            cache.values[layer] = np.concatenate([cache.values[layer], v])
        cache.positions = np.concatenate([cache.positions, positions])

    def rollback(self, cache: ContextCache, length: int) -> None:
        """Drop every cached row whose position is ``>= length`` (the rows of rejected tokens)."""
        keep = cache.positions < length
        cache.keys = [k[keep] for k in cache.keys]
        cache.values = [v[keep] for v in cache.values]
        cache.positions = cache.positions[keep]

    # ---- block forward ---------------------------------------------------------------------------

    def embed_block(self, anchor: int, rows: int | None = None) -> np.ndarray:
        """``E[[anchor, MASK, ...]] * input_embedding_scale`` — the block's input ``[rows, H]``."""
        rows = self.cfg.block_size if rows is None else rows
        ids = np.full(rows, self.cfg.mask_token_id, dtype=np.int64)
        ids[0] = anchor
        return (self.embed_tokens[ids] * F32(self.cfg.input_embedding_scale)).astype(F32)

    def block_hidden(self, cache: ContextCache, block_input: np.ndarray, p0: int) -> np.ndarray:
        """Run every draft layer over block rows ``block_input [R, H]`` at positions ``p0 .. p0+R-1`` and
        return the final-normed ``hn [R, H]``. Public so tests can feed arbitrary block rows."""
        if cache.length and int(cache.positions.max()) >= p0:
            raise ValueError(
                f"the cache holds rows at positions >= p0={p0}; roll back the rejected rows before proposing"
            )
        h = to_f32(block_input)
        positions = p0 + np.arange(h.shape[0], dtype=np.int64)
        for index in range(self.cfg.num_layers):
            h = self._layer(index, h, cache, positions)
        return rms_norm(h, self.final_norm, self.eps)

    def _layer(self, index: int, h: np.ndarray, cache: ContextCache, positions: np.ndarray) -> np.ndarray:
        """Pre-norm Qwen3 block with KV injection; DFlash2 wraps each sublayer in its conv pair."""
        lw = self.layers[index]
        u = rms_norm(h, lw.input_norm, self.eps)
        x, tail = self._conv_prepare(lw.attention_conv, u)
        a = self._attention(index, x, cache, positions)
        h = h + self._conv_finish(lw.attention_conv, a, tail)
        m = rms_norm(h, lw.post_norm, self.eps)
        x, tail = self._conv_prepare(lw.mlp_conv, m)
        y = (silu(x @ lw.w_gate.T) * (x @ lw.w_up.T)) @ lw.w_down.T
        return (h + self._conv_finish(lw.mlp_conv, y, tail)).astype(F32, copy=False)

    def _conv_prepare(self, conv: ConvWeights | None, u: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Input-side conv; returns the conv'd input and the output-side dynamic taps ``[R, K, H/g]``.

        Both sides' dynamic taps come from one projection of the sublayer's normed input ``u``.
        """
        if conv is None:
            return u, None
        assert self.cfg.dflash2 is not None
        taps, group = self.cfg.dflash2.conv_kernel_size, self.cfg.dflash2.conv_group_size
        dyn = (u @ conv.projection.T).reshape(u.shape[0], 2, taps, self.cfg.hidden_size // group)
        return dynamic_conv(u, dyn[:, 0], conv.base[0], group), dyn[:, 1]

    def _conv_finish(self, conv: ConvWeights | None, y: np.ndarray, tail: np.ndarray | None) -> np.ndarray:
        if conv is None:
            return y
        assert self.cfg.dflash2 is not None and tail is not None
        return dynamic_conv(y, tail, conv.base[1], self.cfg.dflash2.conv_group_size)

    def _attention(self, index: int, x: np.ndarray, cache: ContextCache, positions: np.ndarray) -> np.ndarray:
        """Block queries over cached context K/V plus the block's own (uncached) K/V."""
        cfg, lw = self.cfg, self.layers[index]
        rows, heads, kv_heads, dim = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = rms_norm((x @ lw.wq.T).reshape(rows, heads, dim), lw.q_norm, self.eps)
        q = rope(q, positions, self.inv_freq, self.attention_factor)
        kb = rms_norm((x @ lw.wk.T).reshape(rows, kv_heads, dim), lw.k_norm, self.eps)
        kb = rope(kb, positions, self.inv_freq, self.attention_factor)
        vb = (x @ lw.wv.T).reshape(rows, kv_heads, dim).astype(F32, copy=False)
        keys = np.concatenate([cache.keys[index], kb])
        values = np.concatenate([cache.values[index], vb])
        key_positions = np.concatenate([cache.positions, positions])
        out = attend(cfg.layers[index], q, keys, values, positions, key_positions)
        return (out.reshape(rows, heads * dim) @ lw.wo.T).astype(F32, copy=False)

    # ---- heads -----------------------------------------------------------------------------------

    def output_logits(self, hn_rows: np.ndarray) -> np.ndarray:
        """Target head on draft rows, then ``* output_multiplier`` and the optional ``tanh`` softcap."""
        logits = (hn_rows @ self.lm_head.T) * F32(self.cfg.output_multiplier)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = np.tanh(logits / F32(cap)) * F32(cap)
        return logits.astype(F32, copy=False)

    def markov_walk(
        self, logits: np.ndarray, hn_rows: np.ndarray, anchor: int
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """DSpark's sequential greedy walk: ``logits_i + w2 @ w1[prev_i]``, ``prev_0 = anchor``.

        The confidence of draft ``i`` reads the same ``prev_i`` as its Markov bias:
        ``sigmoid(w · [hn_i ; w1[prev_i]] + b)`` (``hn_i`` alone without ``confidence_head_with_markov``).
        Returns (tokens, confidences or None, biased logits).
        """
        spec = self.cfg.dspark
        assert spec is not None
        w1, w2 = self.markov["w1"], self.markov["w2"]
        rows = logits.shape[0]
        tokens = np.zeros(rows, dtype=np.int64)
        biased = np.empty_like(logits)
        conf_logits = np.zeros(rows, dtype=F32)
        prev = int(anchor)
        for i in range(rows):
            e = w1[prev]
            biased[i] = logits[i] + w2 @ e
            if spec.enable_confidence_head:
                feats = np.concatenate([hn_rows[i], e]) if spec.confidence_head_with_markov else hn_rows[i]
                conf_logits[i] = self.markov["conf_w"] @ feats + self.markov["conf_b"][0]
            tokens[i] = int(np.argmax(biased[i]))
            prev = int(tokens[i])
        confidences = sigmoid(conf_logits) if spec.enable_confidence_head else None
        return tokens, confidences, biased

    def selector_walk(
        self, logits: np.ndarray, hn_rows: np.ndarray, anchor: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """DFlash2's candidate selector, greedy: per draft row the top-K logits ``U`` and ids ``cand``;
        ``score[k] = U[k] + <A[pred] ⊙ (P hn_i), Bc[cand[k]]>``; take the argmax, ``pred = cand[argmax]``.
        Returns (tokens, scores ``[B-1, K]``, candidates ``[B-1, K]``, gap noise ``[B-1]``, see `Proposal`)."""
        spec = self.cfg.dflash2
        assert spec is not None
        proj, pred_book, succ_book = (self.selector[k] for k in ("hidden_projection", "predecessor", "successor"))
        rows, top_k = logits.shape[0], spec.selector_top_k
        tokens = np.zeros(rows, dtype=np.int64)
        scores = np.zeros((rows, top_k), dtype=F32)
        candidates = np.zeros((rows, top_k), dtype=np.int64)
        gap_noise = np.zeros(rows, dtype=F32)
        pred = int(anchor)
        for i in range(rows):
            cand = top_k_candidates(logits[i], top_k)
            context = pred_book[pred] * (proj @ hn_rows[i])  # [r]
            scores[i] = logits[i, cand] + succ_book[cand] @ context
            candidates[i] = cand
            order = np.argsort(-scores[i], kind="stable")  # order[0] is argmax's pick
            best, second = cand[order[0]], cand[order[min(1, top_k - 1)]]
            slope = proj.T @ ((succ_book[best] - succ_book[second]) * pred_book[pred])  # ∂gap/∂hn_i
            gap_noise[i] = np.linalg.norm(hn_rows[i]) * np.linalg.norm(slope) / np.sqrt(hn_rows.shape[1])
            pred = tokens[i] = int(best)
        return tokens, scores, candidates, gap_noise

    def propose(self, cache: ContextCache, anchor: int, p0: int) -> Proposal:
        """One draft block ``[anchor, MASK × (B-1)]`` at positions ``p0 .. p0+B-1``; the cache is unchanged."""
        hn = self.block_hidden(cache, self.embed_block(anchor), p0)
        logits = self.output_logits(hn[1:])
        if self.cfg.family is Family.DSPARK:
            tokens, confidences, biased = self.markov_walk(logits, hn[1:], anchor)
            return Proposal(tokens, confidences, logits, hn, decision_scores=biased)
        if self.cfg.family is Family.DFLASH2:
            tokens, scores, candidates, gap_noise = self.selector_walk(logits, hn[1:], anchor)
            return Proposal(
                tokens, None, logits, hn, decision_scores=scores, candidates=candidates, gap_noise=gap_noise
            )
        tokens = np.argmax(logits, axis=-1).astype(np.int64)
        return Proposal(tokens, None, logits, hn, decision_scores=logits)


# --------------------------------------------------------------------------------------------------
# Batched, seq-id adapter (the surface of dflash_compiler.protocol.DrafterLike)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchedDrafts:
    """Drafts of one batched propose: ``tokens [nb, γ]`` int64, ``confidences [nb, γ]`` or None, and the
    full per-sequence :class:`Proposal` objects for finer comparisons."""

    tokens: np.ndarray
    confidences: np.ndarray | None
    proposals: tuple[Proposal, ...]


class BatchedReference:
    """The reference behind a seq-id interface: one :class:`ContextCache` per live sequence.

    A sequence's length is one past its highest cached position, and ``propose`` places the block there
    (``p0 = length``), which is how a paged serving cache numbers rows.
    """

    def __init__(self, drafter: ReferenceDrafter) -> None:
        self.drafter = drafter
        self.cfg = drafter.cfg
        self.caches: dict[int, ContextCache] = {}

    def create(self, seq_id: int) -> None:
        if seq_id in self.caches:
            raise ValueError(f"sequence {seq_id} already exists")
        self.caches[seq_id] = self.drafter.new_cache()

    def free(self, seq_id: int) -> None:
        del self.caches[seq_id]

    def rollback(self, seq_id: int, length: int) -> None:
        self.drafter.rollback(self.caches[seq_id], length)

    def length(self, seq_id: int) -> int:
        positions = self.caches[seq_id].positions
        return int(positions.max()) + 1 if positions.shape[0] else 0

    def append_context(
        self, seq_ids: Sequence[int], taps: Sequence[np.ndarray], positions: Sequence[np.ndarray]
    ) -> None:
        for seq_id, rows, pos in zip(seq_ids, taps, positions, strict=True):
            self.drafter.append_context(self.caches[seq_id], rows, pos)

    def propose(self, seq_ids: Sequence[int], anchors: Sequence[int]) -> BatchedDrafts:
        proposals = tuple(
            self.drafter.propose(self.caches[s], int(a), self.length(s)) for s, a in zip(seq_ids, anchors, strict=True)
        )
        gamma = self.cfg.gamma
        tokens = np.stack([p.tokens for p in proposals]) if proposals else np.zeros((0, gamma), np.int64)
        confidences = None
        if proposals and proposals[0].confidences is not None:
            confidences = np.stack([p.confidences for p in proposals if p.confidences is not None])
        return BatchedDrafts(tokens=tokens, confidences=confidences, proposals=proposals)
