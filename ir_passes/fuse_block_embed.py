"""fuse_block_embed: the block's ids and their embedding become one BLOCK_EMBED.

Precondition: ``ids = block_ids(anchors)`` read by exactly one node, an EMBED at argument 0 (``propose`` as
lowered: ``block_ids`` → ``embed``). Ids read by anything else are left alone, as is a phase without them
(``append_context``).

Invariant established: each matched pair is one ``block_embed(anchors, table)`` node under the EMBED's name,
with the BLOCK_IDS's ``block`` and ``mask_token_id`` and the EMBED's ``scale`` and output; the BLOCK_IDS node
is gone. Row ``s * block + k`` is the table row of ``anchors[s]`` for k = 0 and of ``mask_token_id`` else,
times the scale, as before: one kernel computes each row's id and gathers it, and the ids never go to memory.
"""

from __future__ import annotations

from dflash_compiler.ir.graph import Graph, Node
from dflash_compiler.ir.ops import Op

from ._rewrite import fuse_into_sole_reader
from .context import PassContext


def _block_embed(block_ids: Node, embed: Node) -> Node:
    return Node.make(
        Op.BLOCK_EMBED,
        list(embed.outputs),
        block=block_ids.attr("block"),
        mask_token_id=block_ids.attr("mask_token_id"),
        scale=embed.attr("scale"),
    )


def fuse_block_embed(graph: Graph, ctx: PassContext) -> Graph:
    """Fuse every block_ids with the embed that alone reads its ids (module docstring)."""
    return fuse_into_sole_reader(graph, Op.BLOCK_IDS, Op.EMBED, 0, _block_embed)
