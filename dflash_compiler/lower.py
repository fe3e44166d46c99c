"""Lowering: a validated :class:`DrafterConfig` → the two phase graphs of one drafter step.

``append_context`` (all new context rows of a batch, ``ctx`` rows in total):
    taps → fc → hidden_norm → per layer: k_proj → k_norm → RoPE → K write; v_proj → V write.
``propose`` (``nb`` sequences × a block of ``blk`` rows):
    [anchor, MASK…] → embed → L layers over the block rows (attention over the paged context plus the
    block's own K/V) → final norm → rows 1..blk-1 → lm_head → argmax / DFlash2 selector / DSpark walk.

The lowered graphs are straightforward (one node per projection); the passes in ``ir_passes`` fuse them.
Dynamic per-step values (positions, page slots, block tables, cache lengths) are graph inputs, so a
compiled phase is one fixed launch sequence that the runtime can capture once and replay.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_compiler.config import DrafterConfig, Family
from dflash_compiler.ir.graph import Graph, Node, Ref, TensorType
from dflash_compiler.ir.ops import Op
from dflash_compiler.ir.weights import WeightDecl
from dflash_compiler.tensors import expected_drafter_tensors

PAGE_SIZE = 16
ACT = "bfloat16"

APPEND_DIMS = {"ctx": "new context rows in the batch", "pages": "pages in the KV pool"}
PROPOSE_DIMS = {
    "nb": "sequences in the batch",
    "blk": "block rows per sequence (anchor + drafts)",
    "pages": "pages in the KV pool",
    "maxp": "page-table entries per sequence",
}


@dataclass(frozen=True)
class Program:
    """Both phases of one drafter, plus the config they were lowered from."""

    config: DrafterConfig
    append_context: Graph
    propose: Graph

    @property
    def phases(self) -> dict[str, Graph]:
        return {"append_context": self.append_context, "propose": self.propose}

    def with_phases(self, append_context: Graph, propose: Graph) -> Program:
        return Program(self.config, append_context, propose)


class _Builder:
    """Small helpers that keep the lowering readable."""

    def __init__(self, cfg: DrafterConfig, graph: Graph) -> None:
        self.cfg = cfg
        self.g = graph
        self.checkpoint = expected_drafter_tensors(cfg)

    def weight(self, name: str, shape: tuple[int, ...], dtype: str = ACT, decl: WeightDecl | None = None) -> Ref:
        if name in self.g:
            return Ref(name)
        decl = decl or WeightDecl.of(name)
        return self.g.add(name, Node.make(Op.WEIGHT, [TensorType(dtype, shape)], decl=decl))

    def linear(self, name: str, x: Ref, weight: str, rows: str) -> Ref:
        """``x @ W.T`` for a checkpoint weight ``W [N, K]``."""
        n, k = self.checkpoint[weight].shape
        w = self.weight(weight, (n, k))
        return self.g.add(name, Node.make(Op.MATMUL, [TensorType(ACT, (rows, n))]), [x, w])

    def rmsnorm(self, name: str, x: Ref, weight: str, rows: str) -> Ref:
        width = self.g.type_of(x).shape[-1]
        w = self.weight(weight, (width,))
        return self.g.add(
            name, Node.make(Op.RMSNORM, [TensorType(ACT, (rows, width))], eps=self.cfg.rms_norm_eps), [x, w]
        )

    def head_norm_rope(self, prefix: str, x: Ref, norm_weight: str, positions: Ref, heads: int, rows: str) -> Ref:
        cfg = self.cfg
        w = self.weight(norm_weight, (cfg.head_dim,))
        t = TensorType(ACT, (rows, heads * cfg.head_dim))
        normed = self.g.add(
            f"{prefix}_norm",
            Node.make(Op.HEAD_RMSNORM, [t], eps=cfg.rms_norm_eps, head_dim=cfg.head_dim),
            [x, w],
        )
        rope = cfg.rope
        return self.g.add(
            f"{prefix}_rope",
            Node.make(
                Op.ROPE,
                [t],
                head_dim=cfg.head_dim,
                rope=rope.model_dump(mode="json"),
            ),
            [normed, positions],
        )


def kv_cache_type(cfg: DrafterConfig) -> TensorType:
    return TensorType(ACT, (cfg.num_layers, 2, "pages", PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim))


def lower_append_context(cfg: DrafterConfig) -> Graph:
    g = Graph("append_context", dict(APPEND_DIMS))
    b = _Builder(cfg, g)
    taps = g.add("taps", Node.make(Op.INPUT, [TensorType(ACT, ("ctx", cfg.fc_in_features))]))
    positions = g.add("ctx_positions", Node.make(Op.INPUT, [TensorType("int32", ("ctx",))]))
    slots = g.add("ctx_slots", Node.make(Op.INPUT, [TensorType("int32", ("ctx",))]))
    cache = g.add("kv_cache", Node.make(Op.STATE, [kv_cache_type(cfg)]))
    fc = b.linear("fc", taps, "fc.weight", "ctx")
    c = b.rmsnorm("hidden_norm", fc, "hidden_norm.weight", "ctx")
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        k = b.linear(f"l{i}.ctx_k", c, p + "self_attn.k_proj.weight", "ctx")
        v = b.linear(f"l{i}.ctx_v", c, p + "self_attn.v_proj.weight", "ctx")
        k = b.head_norm_rope(f"l{i}.ctx_k", k, p + "self_attn.k_norm.weight", positions, cfg.num_kv_heads, "ctx")
        for which, value in ((0, k), (1, v)):
            cache = g.add(
                f"l{i}.write_{'kv'[which]}",
                Node.make(Op.KV_WRITE, [kv_cache_type(cfg)], layer=i, which=which, page_size=PAGE_SIZE),
                [cache, value, slots],
            )
    g.add("kv_cache_out", Node.make(Op.OUTPUT, [kv_cache_type(cfg)]), [cache])
    return g


def _conv(b: _Builder, name: str, x: Ref, dyn: Ref, base: str, tap: int, rows: str) -> Ref:
    cfg = b.cfg
    assert cfg.dflash2 is not None
    k, gsize = cfg.dflash2.conv_kernel_size, cfg.dflash2.conv_group_size
    width = b.g.type_of(x).shape[-1]
    base_ref = b.weight(base, (2, k, cfg.hidden_size))
    return b.g.add(
        name,
        Node.make(Op.CONV2, [TensorType(ACT, (rows, width))], tap=tap, kernel=k, group=gsize, block=cfg.block_size),
        [x, dyn, base_ref],
    )


def lower_propose(cfg: DrafterConfig) -> Graph:
    g = Graph("propose", dict(PROPOSE_DIMS))
    b = _Builder(cfg, g)
    rows, out_rows = "nb*blk", "nb*(blk-1)"
    H, V = cfg.hidden_size, cfg.vocab_size
    anchors = g.add("anchors", Node.make(Op.INPUT, [TensorType("int32", ("nb",))]))
    positions = g.add("blk_positions", Node.make(Op.INPUT, [TensorType("int32", (rows,))]))
    table = g.add("block_table", Node.make(Op.INPUT, [TensorType("int32", ("nb", "maxp"))]))
    lens = g.add("cache_lens", Node.make(Op.INPUT, [TensorType("int32", ("nb",))]))
    cache = g.add("kv_cache", Node.make(Op.STATE, [kv_cache_type(cfg)]))

    ids = g.add(
        "block_ids",
        Node.make(Op.BLOCK_IDS, [TensorType("int32", (rows,))], block=cfg.block_size, mask_token_id=cfg.mask_token_id),
        [anchors],
    )
    embed = b.weight("target.embed_tokens", (V, H), decl=WeightDecl.of("target.embed_tokens"))
    h = g.add("embed", Node.make(Op.EMBED, [TensorType(ACT, (rows, H))], scale=cfg.input_embedding_scale), [ids, embed])
    for i, layer in enumerate(cfg.layers):
        p, n = f"layers.{i}.", f"l{i}."
        x = b.rmsnorm(n + "input_norm", h, p + "input_layernorm.weight", rows)
        if cfg.family is Family.DFLASH2:
            dyn_a = b.linear(n + "attn_conv_dyn", x, p + "attention_conv.kernel_projection.weight", rows)
            x = _conv(b, n + "attn_conv_in", x, dyn_a, p + "attention_conv.base_kernel", 0, rows)
        q = b.linear(n + "q", x, p + "self_attn.q_proj.weight", rows)
        k = b.linear(n + "k", x, p + "self_attn.k_proj.weight", rows)
        v = b.linear(n + "v", x, p + "self_attn.v_proj.weight", rows)
        q = b.head_norm_rope(n + "q", q, p + "self_attn.q_norm.weight", positions, cfg.num_heads, rows)
        k = b.head_norm_rope(n + "k", k, p + "self_attn.k_norm.weight", positions, cfg.num_kv_heads, rows)
        attn = g.add(
            n + "attention",
            Node.make(
                Op.BLOCK_ATTENTION,
                [TensorType(ACT, (rows, cfg.q_size))],
                layer=i,
                heads=cfg.num_heads,
                kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                block=cfg.block_size,
                causal=layer.causal,
                window=layer.window,
                page_size=PAGE_SIZE,
            ),
            [q, k, v, cache, table, lens, positions],
        )
        o = b.linear(n + "o", attn, p + "self_attn.o_proj.weight", rows)
        if cfg.family is Family.DFLASH2:
            o = _conv(b, n + "attn_conv_out", o, dyn_a, p + "attention_conv.base_kernel", 1, rows)
        h = g.add(n + "attn_residual", Node.make(Op.ADD, [TensorType(ACT, (rows, H))]), [h, o])
        m = b.rmsnorm(n + "post_norm", h, p + "post_attention_layernorm.weight", rows)
        if cfg.family is Family.DFLASH2:
            dyn_m = b.linear(n + "mlp_conv_dyn", m, p + "mlp_conv.kernel_projection.weight", rows)
            m = _conv(b, n + "mlp_conv_in", m, dyn_m, p + "mlp_conv.base_kernel", 0, rows)
        gate = b.linear(n + "gate", m, p + "mlp.gate_proj.weight", rows)
        up = b.linear(n + "up", m, p + "mlp.up_proj.weight", rows)
        act = g.add(
            n + "silu_mul", Node.make(Op.SILU_MUL, [TensorType(ACT, (rows, cfg.intermediate_size))]), [gate, up]
        )
        down = b.linear(n + "down", act, p + "mlp.down_proj.weight", rows)
        if cfg.family is Family.DFLASH2:
            down = _conv(b, n + "mlp_conv_out", down, dyn_m, p + "mlp_conv.base_kernel", 1, rows)
        h = g.add(n + "mlp_residual", Node.make(Op.ADD, [TensorType(ACT, (rows, H))]), [h, down])

    hn = b.rmsnorm("final_norm", h, "norm.weight", rows)
    hd = g.add("drop_anchor", Node.make(Op.DROP_ANCHOR, [TensorType(ACT, (out_rows, H))], block=cfg.block_size), [hn])
    lm = b.weight("target.lm_head", (V, H), decl=WeightDecl.of("target.lm_head"))
    logits = g.add("lm_head", Node.make(Op.LM_HEAD, [TensorType("float32", (out_rows, V))]), [hd, lm])
    if cfg.output_multiplier != 1.0:
        logits = g.add(
            "output_multiplier",
            Node.make(Op.SCALE, [TensorType("float32", (out_rows, V))], factor=cfg.output_multiplier),
            [logits],
        )
    if cfg.final_logit_softcapping is not None:
        logits = g.add(
            "softcap",
            Node.make(Op.SOFTCAP, [TensorType("float32", (out_rows, V))], cap=cfg.final_logit_softcapping),
            [logits],
        )
    tokens_t = TensorType("int32", (out_rows,))
    if cfg.family is Family.DFLASH2:
        assert cfg.dflash2 is not None
        kk, r = cfg.dflash2.selector_top_k, cfg.dflash2.selector_rank
        top = g.add(
            "topk",
            Node.make(Op.TOPK, [TensorType("float32", (out_rows, kk)), TensorType("int32", (out_rows, kk))], k=kk),
            [logits],
        )
        hp = b.linear("selector_hidden", hd, "candidate_selector.hidden_projection.weight", out_rows)
        pred = b.weight("candidate_selector.predecessor_codebook", (V, r))
        succ = b.weight("candidate_selector.successor_codebook", (V, r))
        tokens = g.add(
            "selector",
            Node.make(Op.SELECTOR, [tokens_t], block=cfg.block_size),
            [top, Ref("topk", 1), hp, anchors, pred, succ],
        )
    elif cfg.family is Family.DSPARK:
        assert cfg.dspark is not None
        r = cfg.dspark.markov_rank
        w1 = b.weight("markov_head.markov_w1.weight", (V, r))
        w2 = b.weight("markov_head.markov_w2.weight", (V, r))
        tokens = g.add(
            "markov_walk", Node.make(Op.MARKOV_WALK, [tokens_t], block=cfg.block_size), [logits, anchors, w1, w2]
        )
        if cfg.dspark.enable_confidence_head:
            width = H + r if cfg.dspark.confidence_head_with_markov else H
            pw = b.weight("confidence_head.proj.weight", (1, width))
            pb = b.weight("confidence_head.proj.bias", (1,))
            conf = g.add(
                "confidence",
                Node.make(
                    Op.CONFIDENCE,
                    [TensorType("float32", (out_rows,))],
                    block=cfg.block_size,
                    with_markov=cfg.dspark.confidence_head_with_markov,
                ),
                [hd, tokens, anchors, w1, pw, pb],
            )
            g.add("confidences", Node.make(Op.OUTPUT, [TensorType("float32", (out_rows,))]), [conf])
    else:
        tokens = g.add("argmax", Node.make(Op.ARGMAX, [tokens_t]), [logits])
    g.add("tokens", Node.make(Op.OUTPUT, [tokens_t]), [tokens])
    return g


def lower(cfg: DrafterConfig) -> Program:
    """Lower both phases of ``cfg``."""
    return Program(cfg, lower_append_context(cfg), lower_propose(cfg))
