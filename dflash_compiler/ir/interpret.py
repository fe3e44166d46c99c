"""Execute any graph with numpy (fp32 arithmetic), the semantics every pass must preserve.

``interpret(graph, inputs, weights, state, dims)``:

* ``inputs``: one array per INPUT node, by name;
* ``weights``: a :class:`WeightCache` over checkpoint tensors (WEIGHT nodes are materialized from their
  declarations, so fused and quantized weights are computed exactly as ``pack-weights`` computes them);
* ``state``: one array per STATE node; KV writes update it **in place** (the runtime's cache semantics);
* ``dims``: bindings of the graph's symbolic dims, checked against every node's declared shape.

Returns the OUTPUT nodes' values by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import ml_dtypes
import numpy as np

from dflash_compiler.ir.graph import Graph, Node, Ref, eval_dim
from dflash_compiler.ir.ops import Op
from dflash_compiler.ir.weights import WeightCache, e4m3_as_f32
from dflash_compiler.rope import RopeSpec, apply_rope, cos_sin, rope_tables
from dflash_compiler.weight_tiles import from_tiles

_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


class InterpretError(RuntimeError):
    pass


def _f32(x: np.ndarray) -> np.ndarray:
    if isinstance(x, np.ndarray) and x.dtype == _E4M3:
        return e4m3_as_f32(x)
    return np.asarray(x, dtype=np.float32)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = _f32(x)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * _f32(w)


def _rope_from(node: Node, table: np.ndarray | None) -> tuple[np.ndarray, float]:
    if table is not None:
        return _f32(table).astype(np.float64), float(node.attr("attention_factor"))
    spec = RopeSpec(**dict(node.attr("rope")))
    return rope_tables(spec, int(node.attr("head_dim")))


def _rope(node: Node, args: list[np.ndarray]) -> np.ndarray:
    x, pos = _f32(args[0]), np.asarray(args[1])
    inv_freq, factor = _rope_from(node, args[2] if len(args) > 2 else None)
    d = int(node.attr("head_dim"))
    cos, sin = cos_sin(pos, inv_freq, factor)
    y = apply_rope(x.reshape(x.shape[0], -1, d).astype(np.float64), cos, sin)
    return y.reshape(x.shape).astype(np.float32)


def _kv_write(node: Node, args: list[np.ndarray]) -> np.ndarray:
    cache, values, slots = args
    layer, which, page = int(node.attr("layer")), int(node.attr("which")), int(node.attr("page_size"))
    heads, d = cache.shape[-2], cache.shape[-1]
    slots = np.asarray(slots, np.int64)
    if slots.size and (slots.min() < 0 or slots.max() >= cache.shape[2] * page):
        raise InterpretError(f"kv_write: slot out of range [0, {cache.shape[2] * page})")
    cache[layer, which, slots // page, slots % page] = _f32(values).reshape(-1, heads, d).astype(cache.dtype)
    return cache


def _kv_writes(node: Node, args: list[np.ndarray]) -> np.ndarray:
    cache, slots, rows = args[0], args[1], args[2:]
    page = int(node.attr("page_size"))
    for (layer, which), values in zip(node.attr("targets"), rows, strict=True):
        one = Node.make(Op.KV_WRITE, node.outputs, layer=layer, which=which, page_size=page)
        cache = _kv_write(one, [cache, values, slots])
    return cache


def attention_mask(q_pos: np.ndarray, k_pos: np.ndarray, causal: bool, window: int | None) -> np.ndarray:
    """visible[q, k] for absolute positions (DFLASH.md §1.4)."""
    diff = q_pos[:, None] - k_pos[None, :]
    visible = np.ones(diff.shape, dtype=bool)
    if causal:
        visible &= diff >= 0
    if window is not None:
        visible &= diff < window
        if not causal:
            visible &= -diff < window
    return visible


def _block_attention(node: Node, args: list[np.ndarray]) -> np.ndarray:
    q, kb, vb, cache, table, lens, pos = args
    hq, hkv, d = (int(node.attr(k)) for k in ("heads", "kv_heads", "head_dim"))
    blk, page, layer = int(node.attr("block")), int(node.attr("page_size")), int(node.attr("layer"))
    causal, window = bool(node.attr("causal")), node.attr("window")
    nb = len(lens)
    q = _f32(q).reshape(nb, blk, hq, d)
    kb, vb = _f32(kb).reshape(nb, blk, hkv, d), _f32(vb).reshape(nb, blk, hkv, d)
    pos = np.asarray(pos, np.int64).reshape(nb, blk)
    out = np.empty((nb, blk, hq, d), np.float32)
    group = hq // hkv
    for s in range(nb):
        n = int(lens[s])
        cpos = np.arange(n)
        pages = np.asarray(table[s], np.int64)[cpos // page]
        kc = _f32(cache[layer, 0, pages, cpos % page])
        vc = _f32(cache[layer, 1, pages, cpos % page])
        keys, values = np.concatenate([kc, kb[s]]), np.concatenate([vc, vb[s]])
        visible = attention_mask(pos[s], np.concatenate([cpos, pos[s]]), causal, window)
        for j in range(hq):
            scores = q[s, :, j] @ keys[:, j // group].T / np.sqrt(d)
            scores = np.where(visible, scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[s, :, j] = (p / p.sum(-1, keepdims=True)) @ values[:, j // group]
    return out.reshape(nb * blk, hq * d)


def _conv2(node: Node, args: list[np.ndarray]) -> np.ndarray:
    x, dyn, base = _f32(args[0]), _f32(args[1]), _f32(args[2])
    tap, k, g, blk = (int(node.attr(a)) for a in ("tap", "kernel", "group", "block"))
    rows, width = x.shape
    nb = rows // blk
    dyn = dyn.reshape(nb, blk, 2, k, width // g)[:, :, tap]  # [nb, blk, K, G]
    xs = x.reshape(nb, blk, width)
    out = np.zeros_like(xs)
    for o in range(k):
        shifted = np.zeros_like(xs)
        shifted[:, o:] = xs[:, : blk - o]
        coeff = base[tap, o][None, None, :] + np.repeat(dyn[:, :, o], g, axis=-1)
        out += coeff * shifted
    return out.reshape(rows, width)


def _topk(node: Node, args: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    logits = _f32(args[0])
    k = int(node.attr("k"))
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(logits, ids, -1), ids.astype(np.int32)


def _selector(node: Node, args: list[np.ndarray]) -> np.ndarray:
    vals, cand, hp, anchors, pred_book, succ_book = args
    gamma = int(node.attr("block")) - 1
    vals, hp = _f32(vals), _f32(hp)
    pred_book, succ_book = _f32(pred_book), _f32(succ_book)
    out = np.empty(vals.shape[0], np.int32)
    for s in range(len(anchors)):
        prev = int(anchors[s])
        for i in range(gamma):
            r = s * gamma + i
            score = vals[r] + succ_book[cand[r]] @ (pred_book[prev] * hp[r])
            prev = int(cand[r][int(np.argmax(score))])
            out[r] = prev
    return out


def _markov_walk(node: Node, args: list[np.ndarray]) -> np.ndarray:
    logits, anchors, w1, w2 = _f32(args[0]), args[1], _f32(args[2]), _f32(args[3])
    gamma = int(node.attr("block")) - 1
    out = np.empty(logits.shape[0], np.int32)
    for s in range(len(anchors)):
        prev = int(anchors[s])
        for i in range(gamma):
            r = s * gamma + i
            prev = int(np.argmax(logits[r] + w2 @ w1[prev]))
            out[r] = prev
    return out


def previous_tokens(tokens: np.ndarray, anchors: np.ndarray, gamma: int) -> np.ndarray:
    """prev[i] for each draft row: the anchor for the first row of a sequence, else the previous draft."""
    t = np.asarray(tokens).reshape(len(anchors), gamma)
    return np.concatenate([np.asarray(anchors)[:, None], t[:, :-1]], axis=1).reshape(-1)


def _confidence(node: Node, args: list[np.ndarray]) -> np.ndarray:
    hd, tokens, anchors, w1, pw, pb = args
    gamma = int(node.attr("block")) - 1
    feats = _f32(hd)
    if node.attr("with_markov"):
        prev = previous_tokens(tokens, anchors, gamma)
        feats = np.concatenate([feats, _f32(w1)[prev]], axis=1)
    logit = feats @ _f32(pw)[0] + _f32(pb)[0]
    return (1.0 / (1.0 + np.exp(-logit))).astype(np.float32)


def _block_ids(node: Node, args: list[np.ndarray]) -> np.ndarray:
    anchors = np.asarray(args[0], np.int32)
    ids = np.full((len(anchors), int(node.attr("block"))), int(node.attr("mask_token_id")), np.int32)
    ids[:, 0] = anchors
    return ids.reshape(-1)


def _embed(node: Node, ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    # the rows first, then float32: a table may be the stored one, mapped over its file (sources.py)
    return _f32(table[np.asarray(ids, np.int64)]) * float(node.attr("scale"))


def _drop_anchor(node: Node, args: list[np.ndarray]) -> np.ndarray:
    x = _f32(args[0])
    blk = int(node.attr("block"))
    return x.reshape(-1, blk, x.shape[-1])[:, 1:].reshape(-1, x.shape[-1])


def _weight_rows(node: Node, w: np.ndarray) -> np.ndarray:
    """A linear's weight row-major: tiled weights (attribute ``weight_tiles``, weight_tiles.py) untiled."""
    return from_tiles(w) if node.attr("weight_tiles", 0) else w


def _matmul_fp8(node: Node, args: list[np.ndarray]) -> np.ndarray:
    x, w8, scale = args
    return (_f32(x) @ _f32(_weight_rows(node, w8)).T) * _f32(scale)[None, :]


def _linear(node: Node, args: list[np.ndarray]) -> np.ndarray:
    """x @ W.T, times the per-row scales in the FP8 form (x, W8, scale)."""
    return _matmul_fp8(node, args) if len(args) == 3 else _f32(args[0]) @ _f32(_weight_rows(node, args[1])).T


def _matmul_silu(node: Node, args: list[np.ndarray]) -> np.ndarray:
    y = _linear(node, args)  # x @ W.T, times the scales for an FP8 weight
    group = int(node.attr("group"))
    pairs = y.reshape(y.shape[0], -1, 2, group)  # per row: (gate, up) blocks of `group` columns
    gate, up = pairs[:, :, 0].reshape(y.shape[0], -1), pairs[:, :, 1].reshape(y.shape[0], -1)
    return gate / (1.0 + np.exp(-gate)) * up


def _argmax(logits: np.ndarray) -> np.ndarray:
    return np.argmax(_f32(logits), axis=-1).astype(np.int32)


def _silu_mul(node: Node, args: list[np.ndarray]) -> np.ndarray:
    if len(args) == 1:
        half = args[0].shape[-1] // 2
        a, b = _f32(args[0][:, :half]), _f32(args[0][:, half:])
    else:
        a, b = _f32(args[0]), _f32(args[1])
    return a / (1.0 + np.exp(-a)) * b


def _rmsnorm_residual(node: Node, args: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    s = _f32(args[0]) + _f32(args[1])
    return s, _rms(s, args[2], float(node.attr("eps")))


def _head_rmsnorm(node: Node, args: list[np.ndarray]) -> np.ndarray:
    x = _f32(args[0])
    d = int(node.attr("head_dim"))
    return _rms(x.reshape(x.shape[0], -1, d), args[1], float(node.attr("eps"))).reshape(x.shape)


def _head_prep(node: Node, args: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    x, pos, norm_weights = _f32(args[0]), np.asarray(args[1]), iter(args[3:])
    d, eps = int(node.attr("head_dim")), float(node.attr("eps"))
    cos, sin = cos_sin(pos, *_rope_from(node, args[2]))
    outs = []
    for start, stop, norm, rope in node.attr("windows"):
        heads = x[:, start:stop].reshape(x.shape[0], -1, d)
        if norm:
            heads = _rms(heads, next(norm_weights), eps)
        if rope:
            heads = apply_rope(heads.astype(np.float64), cos, sin).astype(np.float32)
        outs.append(heads.reshape(x.shape[0], stop - start))
    return tuple(outs)


_Impl = Callable[[Node, list[np.ndarray]], np.ndarray | tuple[np.ndarray, ...]]

_IMPL: dict[Op, _Impl] = {
    Op.EMBED: lambda n, a: _embed(n, a[0], a[1]),
    Op.BLOCK_IDS: _block_ids,
    Op.BLOCK_EMBED: lambda n, a: _embed(n, _block_ids(n, a[:1]), a[1]),
    Op.SLICE: lambda n, a: a[0][:, int(n.attr("start")) : int(n.attr("stop"))],
    Op.DROP_ANCHOR: _drop_anchor,
    Op.KV_WRITE: _kv_write,
    Op.KV_WRITES: _kv_writes,
    Op.MATMUL: _linear,
    Op.MATMUL_FP8: _matmul_fp8,
    Op.LM_HEAD: _linear,
    Op.LM_HEAD_ARGMAX: lambda n, a: _argmax(_linear(n, a)),
    Op.MATMUL_SILU: _matmul_silu,
    Op.RMSNORM: lambda n, a: _rms(a[0], a[1], float(n.attr("eps"))),
    Op.RMSNORM_RESIDUAL: _rmsnorm_residual,
    Op.HEAD_RMSNORM: _head_rmsnorm,
    Op.ROPE: _rope,
    Op.HEAD_PREP: _head_prep,
    Op.BLOCK_ATTENTION: _block_attention,
    Op.SILU_MUL: _silu_mul,
    Op.ADD: lambda n, a: _f32(a[0]) + _f32(a[1]),
    Op.SCALE: lambda n, a: _f32(a[0]) * float(n.attr("factor")),
    Op.SOFTCAP: lambda n, a: np.tanh(_f32(a[0]) / float(n.attr("cap"))) * float(n.attr("cap")),
    Op.ARGMAX: lambda n, a: _argmax(a[0]),
    Op.TOPK: _topk,
    Op.CONV2: _conv2,
    Op.SELECTOR: _selector,
    Op.MARKOV_WALK: _markov_walk,
    Op.CONFIDENCE: _confidence,
}


def evaluate_node(node: Node, args: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """One op's outputs for its argument values (fp32 math; kv_write updates its cache argument in place).

    Kernel specs take their numpy reference from here, so a kernel is held to the same semantics as the graph.
    """
    if node.op not in _IMPL:
        raise InterpretError(f"evaluate_node: {node.op.value} is a graph-boundary op, not a computation")
    out = _IMPL[node.op](node, args)
    return out if isinstance(out, tuple) else (out,)


def _check_shape(graph: Graph, name: str, port: int, value: np.ndarray, dims: Mapping[str, int]) -> None:
    declared = graph.node(name).outputs[port].shape
    expected = tuple(eval_dim(d, dims) for d in declared)
    if tuple(value.shape) != expected:
        raise InterpretError(
            f"{graph.name}: {name}:{port} has shape {tuple(value.shape)}, declared {declared} = {expected}"
        )


def interpret(
    graph: Graph,
    inputs: Mapping[str, np.ndarray],
    weights: WeightCache,
    state: Mapping[str, np.ndarray],
    dims: Mapping[str, int],
    capture: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Run ``graph``; when ``capture`` is given, every node's first output is stored in it by name."""
    values: dict[Ref, np.ndarray] = {}
    results: dict[str, np.ndarray] = {}
    for name in graph.topo():
        node = graph.node(name)
        args = [values[ref] for ref in graph.inputs(name)]
        if node.op is Op.INPUT:
            if name not in inputs:
                raise InterpretError(f"{graph.name}: input {name!r} not given")
            out: np.ndarray | tuple[np.ndarray, ...] = np.asarray(inputs[name])
        elif node.op is Op.STATE:
            if name not in state:
                raise InterpretError(f"{graph.name}: state {name!r} not given")
            out = state[name]
        elif node.op is Op.WEIGHT:
            out = weights.get(node.attr("decl"))
        elif node.op is Op.OUTPUT:
            out = args[0]
            results[name] = args[0]
        else:
            out = _IMPL[node.op](node, args)
        outs = out if isinstance(out, tuple) else (out,)
        for port, value in enumerate(outs):
            _check_shape(graph, name, port, value, dims)
            values[Ref(name, port)] = value
        if capture is not None:
            capture[name] = outs[0]
    return results
