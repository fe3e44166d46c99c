"""`Drafter`: load an artifact on the GPU, own its paged KV cache, append context and propose drafts.

Only cuda-python, numpy, ml_dtypes and pydantic are needed (no TVM, no torch). The drafter executes the
artifact's launch plans (runtime/executor.py); what is model-specific was decided at compile time. Its
cache protocol (positions, page slots, page tables) is the one the numpy graph runner uses
(runtime/steps.py), so the two are interchangeable in `protocol.run_scenario`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from dflash_compiler.artifact import CUBIN, WEIGHTS, ArtifactError, Manifest, load_manifest
from dflash_compiler.runtime.cuda import Device, Module, Stream
from dflash_compiler.runtime.executor import PhaseExecutor
from dflash_compiler.runtime.pages import PageAllocator
from dflash_compiler.runtime.steps import context_step, propose_step

_HOST_DTYPES: dict[str, Any] = {
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
    "int32": np.int32,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
}


@dataclass(frozen=True)
class Drafts:
    tokens: np.ndarray  # int32 [nb, gamma]
    confidences: np.ndarray | None  # float32 [nb, gamma] (DSpark with a confidence head)


def rebuild_command(manifest: Manifest, target: str) -> str:
    return (
        f"dflash-compile compile DRAFTER_DIR --target-model TARGET_DIR --target {target} "
        f"-o artifacts/{manifest.name.rsplit('-', 1)[0]}-{target}"
    )


class Drafter:
    """A loaded artifact. Create sequences, append their context rows, propose blocks of drafts."""

    def __init__(
        self,
        path: Path,
        manifest: Manifest,
        device: Device,
        use_graphs: bool = True,
        external_weights: Mapping[str, int] | None = None,
    ) -> None:
        self.path, self.manifest, self.device, self.use_graphs = path, manifest, device, use_graphs
        self.module = Module((path / CUBIN).read_bytes())
        self.stream = Stream()
        self._owned: list[int] = []
        self.weights = self._upload_weights(dict(external_weights or {}))
        kv = manifest.kv_cache
        self.kv = device.alloc(kv.total_bytes)
        self._owned.append(self.kv)
        device.zero(self.kv, kv.total_bytes)
        self.pages = PageAllocator(kv.num_pages, kv.page_size, manifest.options.max_seq_len)
        external = {**self.weights, "kv_cache": self.kv}
        self.phases = {
            name: PhaseExecutor(device, self.module, plan, manifest.kernels, external)
            for name, plan in manifest.phases.items()
        }

    @classmethod
    def load(
        cls,
        path: str | Path,
        use_graphs: bool = True,
        external_weights: Mapping[str, Any] | None = None,
        device: Device | None = None,
    ) -> Drafter:
        """Verify and load `path`; `external_weights` maps weight names (e.g. `target.lm_head`) to device
        tensors the serving engine already holds (an int address, or an object exposing
        `__cuda_array_interface__`); those are used in place and not uploaded."""
        path = Path(path)
        required = (CUBIN,) if external_weights and set(external_weights) else (CUBIN, WEIGHTS)
        manifest = load_manifest(path, require=required)
        device = device or Device()
        found = device.compute_capability
        if found != manifest.target.compute_capability:
            want = ".".join(map(str, manifest.target.compute_capability))
            here = f"sm_{found[0]}{found[1]}"
            raise ArtifactError(
                f"{path} was built for {manifest.target.name} (compute capability {want}); this GPU ({device.name}) "
                f"is {found[0]}.{found[1]}. Fix: rebuild for it: {rebuild_command(manifest, here)}"
            )
        pointers = {name: _device_address(name, value, manifest) for name, value in (external_weights or {}).items()}
        return cls(path, manifest, device, use_graphs, pointers)

    def _upload_weights(self, external: dict[str, int]) -> dict[str, int]:
        from dflash_compiler.weights import WeightSet

        needed = set(self.manifest.weights) - set(external)
        if not needed:
            return external
        stored = WeightSet(self.path / WEIGHTS)
        out = dict(external)
        for name in sorted(needed):
            record = self.manifest.weights[name]
            array = stored.get(name)
            if tuple(array.shape) != tuple(record.shape) or array.dtype != np.dtype(_HOST_DTYPES[record.dtype]):
                raise ArtifactError(
                    f"{self.path / WEIGHTS}: tensor {name} is {array.dtype}{list(array.shape)}, the manifest says "
                    f"{record.dtype}{list(record.shape)}. Fix: re-run pack-weights"
                )
            pointer = self.device.upload(array)
            self._owned.append(pointer)
            out[name] = pointer
        return out

    # sequences ----------------------------------------------------------------------------------
    def create(self, seq_id: int) -> None:
        self.pages.create(seq_id)

    def free(self, seq_id: int) -> None:
        self.pages.free(seq_id)

    def rollback(self, seq_id: int, length: int) -> None:
        self.pages.rollback(seq_id, length)

    def length(self, seq_id: int) -> int:
        return self.pages.length(seq_id)

    # phases -------------------------------------------------------------------------------------
    def append_context(self, seq_ids: Sequence[int], taps: Sequence[Any], positions: Sequence[Any]) -> None:
        """Write each sequence's new context rows into the cache (`taps[i]`: [C_i, T*H_t], host arrays).

        Rows beyond the build's `max_ctx_rows` are processed in several launches of the phase.
        """
        step = context_step(self.pages, seq_ids, [np.asarray(p) for p in positions])
        rows = np.concatenate([np.asarray(t, np.float32) for t in taps]).astype(ml_dtypes.bfloat16)
        phase = self.phases["append_context"]
        chunk = phase.maxima["ctx"]
        for start in range(0, len(step.slots), chunk):
            part = slice(start, start + chunk)
            n = len(step.slots[part])
            phase.write_input("taps", rows[part], self.stream)
            phase.write_input("ctx_positions", step.positions[part], self.stream)
            phase.write_input("ctx_slots", step.slots[part], self.stream)
            phase.run({"ctx": n, "pages": self.manifest.kv_cache.num_pages}, self.stream)
        self.stream.synchronize()

    def propose(self, seq_ids: Sequence[int], anchors: Sequence[int]) -> Drafts:
        """Draft `block_size - 1` tokens per sequence; the anchor sits at the sequence's cached length."""
        nb = len(seq_ids)
        kv = self.manifest.kv_cache
        if not 1 <= nb <= self.manifest.options.max_batch:
            raise ValueError(f"propose takes 1 to {self.manifest.options.max_batch} sequences, got {nb}")
        blk = self.manifest.block_size
        step = propose_step(self.pages, seq_ids, blk, kv.pages_per_seq)
        phase = self.phases["propose"]
        phase.write_input("anchors", np.asarray(anchors, np.int32), self.stream)
        phase.write_input("blk_positions", step.positions, self.stream)
        phase.write_input("block_table", step.block_table, self.stream)
        phase.write_input("cache_lens", step.cache_lens, self.stream)
        dims = {"nb": nb, "blk": blk, "pages": kv.num_pages, "maxp": kv.pages_per_seq}
        if self.use_graphs:
            phase.run_graph(dims, self.stream)
        else:
            phase.run(dims, self.stream)
        outputs = dict(phase.plan.outputs)
        tokens = phase.read_value(outputs["tokens"], dims, np.int32, self.stream)
        conf = None
        if "confidences" in outputs:
            conf = phase.read_value(outputs["confidences"], dims, np.float32, self.stream).reshape(nb, blk - 1)
        return Drafts(tokens.reshape(nb, blk - 1), conf)

    def close(self) -> None:
        for phase in self.phases.values():
            phase.close()
        for pointer in self._owned:
            self.device.free(pointer)
        self._owned.clear()
        self.stream.destroy()


def _device_address(name: str, value: Any, manifest: Manifest) -> int:
    """A device pointer from an int or a `__cuda_array_interface__` object, checked against the manifest."""
    if name not in manifest.weights:
        raise ArtifactError(
            f"external weight {name!r} is not a weight of this artifact; known: {sorted(manifest.weights)}"
        )
    if isinstance(value, int):
        return value
    iface = getattr(value, "__cuda_array_interface__", None)
    if iface is None:
        raise ArtifactError(
            f"external weight {name}: expected a device address (int) or an object with __cuda_array_interface__, "
            f"found {type(value).__name__}"
        )
    record = manifest.weights[name]
    if tuple(iface["shape"]) != tuple(record.shape):
        raise ArtifactError(f"external weight {name}: shape {tuple(iface['shape'])}, expected {record.shape}")
    if iface.get("strides") not in (None, ()):
        raise ArtifactError(f"external weight {name}: must be contiguous (row-major)")
    return int(iface["data"][0])
