"""The PyTorch peer of `bench/propose.py`: the drafter step as a serving stack would write it in PyTorch, from the
artifact's own packed weights (tiled weights turned back row-major), timed on the GPU behind a host gate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


class TorchPeer:
    """The same step in PyTorch: static KV cache per layer, fused QKV / gate-up / context K/V weights,
    SDPA with GQA, bf16; append + propose captured in one CUDA graph."""

    def __init__(
        self, weights: dict[str, Any], cfg: Any, nb: int, cached: int, new_rows: int, dev: str = "cuda"
    ) -> None:
        import torch

        self.torch = torch
        self.w, self.cfg, self.nb, self.cached, self.new_rows = weights, cfg, nb, cached, new_rows
        bf16 = torch.bfloat16
        self.L, self.H, self.Hq, self.Hkv, self.D = (
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.B = cfg.block_size
        self.len = cached + self.new_rows
        total = self.len + self.B
        self.k = torch.randn(self.L, nb, self.Hkv, total, self.D, device=dev, dtype=bf16)
        self.v = torch.randn(self.L, nb, self.Hkv, total, self.D, device=dev, dtype=bf16)
        self.taps = torch.randn(nb * self.new_rows, cfg.fc_in_features, device=dev, dtype=bf16)
        self.anchors = torch.zeros(nb, dtype=torch.long, device=dev)
        inv = weights["rope.inv_freq"].float()
        pos_ctx = torch.arange(cached, self.len, device=dev).float()
        pos_blk = torch.arange(self.len, total, device=dev).float()
        self.cos_ctx, self.sin_ctx = self._table(pos_ctx, inv)
        self.cos_blk, self.sin_blk = self._table(pos_blk, inv)
        self.mask_ids = torch.full((nb, self.B - 1), cfg.mask_token_id, dtype=torch.long, device=dev)
        self.eps = cfg.rms_norm_eps
        self.graph = None
        self.tokens = None

    def _table(self, pos: Any, inv: Any) -> tuple[Any, Any]:
        f = pos[:, None] * inv[None, :]
        emb = self.torch.cat([f, f], dim=-1)
        return emb.cos().to(self.torch.bfloat16), emb.sin().to(self.torch.bfloat16)

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:  # x [..., T, D] with T matching cos rows
        half = self.D // 2
        rotated = self.torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _rms(self, x: Any, w: Any) -> Any:
        return self.torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), w.float(), self.eps).to(x.dtype)

    def step(self) -> Any:
        torch, w, nb, B = self.torch, self.w, self.nb, self.B
        F = torch.nn.functional
        # append_context: fc -> hidden_norm -> fused K/V of every layer -> k_norm + rope -> static cache
        c = self._rms(self.taps @ w["fc.weight"].T, w["hidden_norm.weight"])
        kv = (c @ w["ctx_kv.weight"].T).view(nb, self.new_rows, self.L, 2, self.Hkv, self.D)
        for layer in range(self.L):
            kc = self._rms(kv[:, :, layer, 0], w[f"layers.{layer}.self_attn.k_norm.weight"]).transpose(1, 2)
            self.k[layer, :, :, self.cached : self.len] = self._rope(kc, self.cos_ctx, self.sin_ctx)
            self.v[layer, :, :, self.cached : self.len] = kv[:, :, layer, 1].transpose(1, 2)
        # propose: embed [anchor, MASK...] -> layers over the cached rows + the block's own K/V -> lm_head
        ids = torch.cat([self.anchors[:, None], self.mask_ids], dim=1).reshape(-1)
        h = w["target.embed_tokens"][ids]
        for layer in range(self.L):
            p = f"layers.{layer}."
            x = self._rms(h, w[p + "input_layernorm.weight"])
            qkv = x @ w[f"l{layer}.qkv.weight"].T
            q, k, v = qkv.split([self.Hq * self.D, self.Hkv * self.D, self.Hkv * self.D], dim=-1)
            q = self._rms(q.view(nb, B, self.Hq, self.D), w[p + "self_attn.q_norm.weight"]).transpose(1, 2)
            k = self._rms(k.view(nb, B, self.Hkv, self.D), w[p + "self_attn.k_norm.weight"]).transpose(1, 2)
            q = self._rope(q, self.cos_blk, self.sin_blk)
            self.k[layer, :, :, self.len :] = self._rope(k, self.cos_blk, self.sin_blk)
            self.v[layer, :, :, self.len :] = v.view(nb, B, self.Hkv, self.D).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, self.k[layer], self.v[layer], enable_gqa=True)
            h = h + o.transpose(1, 2).reshape(nb * B, self.Hq * self.D) @ w[p + "self_attn.o_proj.weight"].T
            m = self._rms(h, w[p + "post_attention_layernorm.weight"])
            g, u = (m @ w[f"l{layer}.gate_up.weight"].T).chunk(2, dim=-1)
            h = h + (F.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
        hn = self._rms(h, w["norm.weight"]).view(nb, B, self.H)[:, 1:]
        logits = hn.reshape(nb * (B - 1), self.H) @ w["target.lm_head"].T
        return logits.float().argmax(-1).view(nb, B - 1)

    def capture(self) -> None:
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.tokens = self.step()

    def time(self, repeats: int) -> list[float]:
        """GPU ms of `repeats` replays, each behind a host gate as the drafter's are, on a stream of its own
        (the gate holds the whole stream, which must not be the default one other work waits on)."""
        from dflash_compiler.runtime.cuda import HostGate

        torch = self.torch
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        samples = []
        with torch.cuda.stream(stream), HostGate() as gate:
            self.graph.replay()
            stream.synchronize()
            for _ in range(repeats):
                with gate.held(stream.cuda_stream):
                    start.record()
                    self.graph.replay()
                    stop.record()
                stop.synchronize()
                samples.append(start.elapsed_time(stop))
        return samples


def torch_weights(artifact: Path, dev: str = "cuda") -> dict[str, Any]:
    import torch

    from dflash_compiler.artifact import WEIGHTS, load_manifest
    from dflash_compiler.weight_tiles import from_tiles
    from dflash_compiler.weights import WeightSet

    stored = WeightSet(artifact / WEIGHTS)
    manifest = load_manifest(artifact, unread=(WEIGHTS,))
    out = {}
    for name in stored.names():
        a = stored.get(name)
        if manifest.weights[name].decl["transform"] == "tiles":  # the peer multiplies row-major weights
            a = from_tiles(a)
        if str(a.dtype) == "bfloat16":
            out[name] = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(dev)
        else:
            out[name] = torch.from_numpy(np.asarray(a, np.float32)).to(dev)
    return out
