"""The operator set of the drafter graph IR, grouped by kind."""

from __future__ import annotations

from enum import StrEnum


class OpKind(StrEnum):
    IO = "io"
    MEMORY = "memory"
    LINEAR = "linear"
    NORM = "norm"
    POSITION = "position"
    ATTENTION = "attention"
    ELEMENTWISE = "elementwise"
    OUTPUT = "output"
    DFLASH2 = "dflash2"
    DSPARK = "dspark"


class Op(StrEnum):
    # io: graph boundary
    INPUT = "input"  # a runtime input (activations, positions, page slots, block tables)
    WEIGHT = "weight"  # a named weight tensor (maps to checkpoint tensors through a transform)
    STATE = "state"  # persistent device state (the paged KV cache)
    OUTPUT = "output"  # marks a graph result
    # memory
    EMBED = "embed"  # rows of a table gathered by id, times a scale
    BLOCK_IDS = "block_ids"  # [anchor, MASK, ..., MASK] per sequence
    BLOCK_EMBED = "block_embed"  # EMBED of BLOCK_IDS's ids, the ids never stored
    SLICE = "slice"  # a column range of a 2-D tensor
    DROP_ANCHOR = "drop_anchor"  # block rows 1..B-1 of each sequence
    KV_WRITE = "kv_write"  # rows of K or V of one layer into their page slots
    KV_WRITES = "kv_writes"  # several such writes sharing the slots: (layer, K or V) targets, one update
    # linear
    MATMUL = "matmul"  # y = x @ W.T (W [N, K], bf16/fp32)
    MATMUL_FP8 = "matmul_fp8"  # y = (x @ W8.T) * scale[N] (W8 e4m3, per-output-row fp32 scale)
    LM_HEAD = "lm_head"  # logits = x @ E.T over the target vocabulary; FP8 form (x, E8, scale)
    # silu(gate) * up of a gate|up projection whose weight rows (and FP8 scales) are interleaved `group` at a time
    MATMUL_SILU = "matmul_silu"
    LM_HEAD_ARGMAX = "lm_head_argmax"  # argmax of lm_head's logits per row, the logits never stored
    # norm
    RMSNORM = "rmsnorm"  # w * x / sqrt(mean(x^2) + eps) over the last dim
    RMSNORM_RESIDUAL = "rmsnorm_residual"  # (s = a + b, rmsnorm(s)): two outputs
    HEAD_RMSNORM = "head_rmsnorm"  # per-head RMSNorm over head_dim (q_norm / k_norm)
    # position
    ROPE = "rope"  # neox rotate-half RoPE from an inv_freq table and attention factor
    # column windows of one tensor, each copied or per-head RMS-normed and/or RoPE'd: one output per window
    HEAD_PREP = "head_prep"
    # attention
    BLOCK_ATTENTION = "block_attention"  # block rows over the paged context + the block's own K/V
    # elementwise
    SILU_MUL = "silu_mul"  # silu(a) * b, or of the two column halves of one input
    ADD = "add"
    SCALE = "scale"  # x * factor
    SOFTCAP = "softcap"  # tanh(x / cap) * cap
    # output
    ARGMAX = "argmax"  # index of the row maximum (lowest index on ties)
    TOPK = "topk"  # the k largest values and their ids, descending: two outputs
    # DFlash2
    CONV2 = "conv2"  # grouped dynamic conv over block rows (one tap set of the pair)
    SELECTOR = "selector"  # greedy candidate-selector walk over the top-k candidates
    # DSpark
    MARKOV_WALK = "markov_walk"  # greedy walk adding the Markov bias of the previous token
    CONFIDENCE = "confidence"  # acceptance confidence per draft position

    @property
    def kind(self) -> OpKind:
        return _KIND[self]


_KIND: dict[Op, OpKind] = {
    Op.INPUT: OpKind.IO,
    Op.WEIGHT: OpKind.IO,
    Op.STATE: OpKind.IO,
    Op.OUTPUT: OpKind.IO,
    Op.EMBED: OpKind.MEMORY,
    Op.BLOCK_IDS: OpKind.MEMORY,
    Op.BLOCK_EMBED: OpKind.MEMORY,
    Op.SLICE: OpKind.MEMORY,
    Op.DROP_ANCHOR: OpKind.MEMORY,
    Op.KV_WRITE: OpKind.MEMORY,
    Op.KV_WRITES: OpKind.MEMORY,
    Op.MATMUL: OpKind.LINEAR,
    Op.MATMUL_FP8: OpKind.LINEAR,
    Op.LM_HEAD: OpKind.LINEAR,
    Op.LM_HEAD_ARGMAX: OpKind.LINEAR,
    Op.MATMUL_SILU: OpKind.LINEAR,
    Op.RMSNORM: OpKind.NORM,
    Op.RMSNORM_RESIDUAL: OpKind.NORM,
    Op.HEAD_RMSNORM: OpKind.NORM,
    Op.ROPE: OpKind.POSITION,
    Op.HEAD_PREP: OpKind.POSITION,
    Op.BLOCK_ATTENTION: OpKind.ATTENTION,
    Op.SILU_MUL: OpKind.ELEMENTWISE,
    Op.ADD: OpKind.ELEMENTWISE,
    Op.SCALE: OpKind.ELEMENTWISE,
    Op.SOFTCAP: OpKind.ELEMENTWISE,
    Op.ARGMAX: OpKind.OUTPUT,
    Op.TOPK: OpKind.OUTPUT,
    Op.CONV2: OpKind.DFLASH2,
    Op.SELECTOR: OpKind.DFLASH2,
    Op.MARKOV_WALK: OpKind.DSPARK,
    Op.CONFIDENCE: OpKind.DSPARK,
}


# Arguments a node reads only a few rows of, picked by id (a table lookup), rather than whole: the
# embedding table of EMBED and BLOCK_EMBED and the Markov head's w1 of MARKOV_WALK. A step's DRAM traffic counts the
# whole of every other weight it reads, and only the gathered rows of these.
GATHERED_ARGS: dict[Op, int] = {Op.EMBED: 1, Op.BLOCK_EMBED: 1, Op.MARKOV_WALK: 2}

# Head dims HEAD_PREP takes: half a head in whole 16-byte bf16 vectors, one per lane, over a power-of-two
# number of lanes of one warp (head_dim / 16 = 1, 2, 4, ..., 32).
HEAD_PREP_HEAD_DIMS: tuple[int, ...] = tuple(16 << i for i in range(6))

# Ops whose output is their first input (the paged KV cache) updated in place.
CACHE_WRITES: tuple[Op, ...] = (Op.KV_WRITE, Op.KV_WRITES)
