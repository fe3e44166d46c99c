"""`Drafter`: load an artifact on the GPU, own its paged KV cache, append context and propose drafts.

Only cuda-python, numpy, ml_dtypes and pydantic are needed (no TVM, no torch). The drafter executes the
artifact's launch plans (runtime/executor.py); what is model-specific was decided at compile time. Its
cache protocol (positions, page slots, page tables) is the one the numpy graph runner uses
(runtime/steps.py), so the two are interchangeable in `protocol.run_scenario`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from dflash_compiler.artifact import (
    CUBIN,
    WEIGHTS,
    ArtifactError,
    Manifest,
    load_manifest,
    require_files,
    verify_files,
)
from dflash_compiler.plans import numpy_dtype
from dflash_compiler.protocol import ContextRows
from dflash_compiler.row_blocks import cast_rows
from dflash_compiler.runtime.cuda import Device, Module, Stream
from dflash_compiler.runtime.device_array import DeviceArray, device_array
from dflash_compiler.runtime.executor import GraphCache, PhaseExecutor
from dflash_compiler.runtime.pages import PageAllocator, PagedSequences
from dflash_compiler.runtime.steps import ContextStep, context_step, padded_context, propose_step


@dataclass(frozen=True)
class Drafts:
    tokens: np.ndarray  # int32 [nb, gamma]
    confidences: np.ndarray | None  # float32 [nb, gamma] (DSpark with a confidence head)


def rebuild_command(manifest: Manifest, target: str) -> str:
    return (
        f"dflash-compile compile DRAFTER_DIR --target-model TARGET_DIR --target {target} "
        f"-o artifacts/{manifest.name.rsplit('-', 1)[0]}-{target}"
    )


class Drafter(PagedSequences):
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
        self.module = Module((path / CUBIN).read_bytes(), dependent_launch=manifest.options.dependent_launch)
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
        self.graphs = GraphCache()  # `step`'s graphs of both phases

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
        # every file it reads has its hash checked once, here: the weights file only if some weight is not external
        manifest = load_manifest(path, require=(CUBIN,), unread=(WEIGHTS,))
        if set(manifest.weights) - set(external_weights or {}):
            require_files(path, manifest, (WEIGHTS,))
            verify_files(path, manifest, (WEIGHTS,))
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
            if tuple(array.shape) != tuple(record.shape) or array.dtype != numpy_dtype(record.dtype):
                raise ArtifactError(
                    f"{self.path / WEIGHTS}: tensor {name} is {array.dtype}{list(array.shape)}, the manifest says "
                    f"{record.dtype}{list(record.shape)}. Fix: re-run pack-weights"
                )
            pointer = self.device.upload(array)
            self._owned.append(pointer)
            out[name] = pointer
        return out

    # phases -------------------------------------------------------------------------------------
    def append_context(self, seq_ids: Sequence[int], taps: Sequence[Any], positions: Sequence[Any]) -> None:
        """Write each sequence's new context rows into the cache.

        `taps[i]` is [C_i, T*H_t]: a host array (bf16 copied as given, other floats rounded to bf16), or a
        bf16 device tensor (DLPack or `__cuda_array_interface__`), copied device to device. Rows beyond the
        build's `max_ctx_rows` are processed in several launches of the phase.
        """
        append = self.phases["append_context"]
        for dims, _ in self._context_pieces(seq_ids, taps, positions):
            self._replay([(append, dims)])
        self.stream.synchronize()

    def step(self, rows: ContextRows, seq_ids: Sequence[int], anchors: Sequence[int]) -> Drafts:
        """`append_context` of `rows`, each of their sequences rolled back to the rows it keeps, then
        `propose(seq_ids, anchors)`, as one replay: the last context rows' launches and the proposal's are one
        CUDA graph, with no host synchronisation or graph boundary between the phases. Rows beyond
        `max_ctx_rows` go first, in launches of their own, as `append_context` does.

        Host wall time of one Qwen3-8B drafter step on an H100 (bench/propose.py: 7 new rows a sequence,
        4096 cached, drafts read back), `append_context` then `propose` → `step`: bf16 2.014 → 1.505 ms at
        nb = 1 and 4.370 → 2.905 at nb = 8, FP8 1.848 → 1.147 and 3.224 → 2.328 ms, while `append_context`
        launched its kernels one by one. With its launches a graph replay too, the two take as long (one run:
        bf16 1.542 → 1.539 ms at nb = 1, FP8 1.019 → 1.016), and on the GPU the one graph saves only the
        boundary between two (bf16 1.239 ms either way at nb = 1, FP8 0.733 → 0.731)."""
        self._check_proposal(seq_ids, anchors)  # before any row is appended
        append = self.phases["append_context"]
        tail: list[tuple[PhaseExecutor, dict[str, int]]] = []
        for dims, last in self._context_pieces(rows.seq_ids, rows.taps, rows.positions):
            if last:
                tail.append((append, dims))
            else:
                self._replay([(append, dims)])
        rows.roll_back(self)
        propose, dims = self._stage_proposal(seq_ids, anchors)
        self._replay([*tail, (propose, dims)])
        return self._drafts(dims, len(seq_ids))

    def _replay(self, chain: Sequence[tuple[PhaseExecutor, Mapping[str, int]]]) -> None:
        """Queue `chain`'s launches: one CUDA graph (captured on first use of these phases and dims), or plain
        launches where the drafter was loaded without graphs."""
        if self.use_graphs:
            self.graphs.run(chain, self.stream)
        else:
            for phase, dims in chain:
                phase.run(dims, self.stream)

    def _context_pieces(
        self, seq_ids: Sequence[int], taps: Sequence[Any], positions: Sequence[Any]
    ) -> Iterator[tuple[dict[str, int], bool]]:
        """Reserve the rows' pages, then per piece of at most `max_ctx_rows` rows write the phase's inputs
        (queued on the stream), padded as `steps.padded_context` says, and yield its dims and whether it is the
        last piece; the caller queues the piece's launches before asking for the next, whose inputs overwrite
        these."""
        step = context_step(self.pages, seq_ids, [np.asarray(p) for p in positions])
        phase = self.phases["append_context"]
        width = int(phase.plan.values["taps"].shape[1])
        pieces = [self._rows(t, width, f"taps[{i}]") for i, t in enumerate(taps)]
        chunk = phase.maxima["ctx"]
        kv = self.manifest.kv_cache
        total = len(step.slots)
        for start in range(0, total, chunk):
            stop = min(total, start + chunk)
            piece = padded_context(ContextStep(step.positions[start:stop], step.slots[start:stop]), chunk, kv.page_size)
            rows = len(piece.slots)
            self._gather_rows(phase, "taps", pieces, start, stop, width)
            if rows > stop - start:  # the pad rows' taps
                pad_at = phase.base["taps"] + (stop - start) * width * 2
                self.device.memset_async(pad_at, (rows - (stop - start)) * width * 2, self.stream)
            phase.write_input("ctx_positions", piece.positions, self.stream)
            phase.write_input("ctx_slots", piece.slots, self.stream)
            yield {"ctx": rows, "pages": kv.num_pages}, stop == total

    @staticmethod
    def _rows(value: Any, width: int, what: str) -> np.ndarray | DeviceArray:
        if isinstance(value, np.ndarray) or not (
            hasattr(value, "__dlpack__") or hasattr(value, "__cuda_array_interface__")
        ):
            rows = np.asarray(value)
            if rows.ndim != 2 or rows.shape[1] != width:
                raise ValueError(f"{what}: expected [rows, {width}], found {list(rows.shape)}")
            if rows.dtype == ml_dtypes.bfloat16:  # as a serving engine holds them: copied as given
                return rows
            # other floats: rounded to bf16 once, through float32 (a block of rows at a time on every core)
            return cast_rows(rows.astype(np.float32, copy=False), ml_dtypes.bfloat16)
        array = device_array(value)
        if len(array.shape) != 2 or array.shape[1] != width or array.dtype != "bfloat16":
            raise ValueError(
                f"{what}: expected a bfloat16 [rows, {width}] device tensor, found {array.dtype}{list(array.shape)}"
            )
        return array

    def _gather_rows(
        self,
        phase: PhaseExecutor,
        name: str,
        pieces: Sequence[np.ndarray | DeviceArray],
        start: int,
        stop: int,
        width: int,
    ) -> None:
        """Rows [start, stop) of the concatenated pieces into input `name` (host pieces in one copy)."""
        row_bytes = width * 2
        base = phase.base[name]
        offset = 0
        for piece in pieces:
            rows = piece.shape[0]
            lo, hi = max(start, offset), min(stop, offset + rows)
            if lo < hi:
                dst = base + (lo - start) * row_bytes
                if isinstance(piece, DeviceArray):
                    self.device.copy(
                        dst, piece.pointer + (lo - offset) * row_bytes, (hi - lo) * row_bytes, self.stream.handle
                    )
                else:
                    self.device.upload(piece[lo - offset : hi - offset], dst, self.stream)
            offset += rows

    def propose(self, seq_ids: Sequence[int], anchors: Sequence[int]) -> Drafts:
        """Draft `block_size - 1` tokens per sequence; the anchor sits at the sequence's cached length."""
        phase, dims = self._stage_proposal(seq_ids, anchors)
        self._replay([(phase, dims)])
        return self._drafts(dims, len(seq_ids))

    def _stage_proposal(self, seq_ids: Sequence[int], anchors: Sequence[int]) -> tuple[PhaseExecutor, dict[str, int]]:
        """Write a proposal's inputs (queued on the stream); the propose phase and its dims."""
        self._check_proposal(seq_ids, anchors)
        kv = self.manifest.kv_cache
        blk = self.manifest.block_size
        step = propose_step(self.pages, seq_ids, blk, kv.pages_per_seq)
        phase = self.phases["propose"]
        phase.write_input("anchors", np.asarray(anchors, np.int32), self.stream)
        phase.write_input("blk_positions", step.positions, self.stream)
        phase.write_input("block_table", step.block_table, self.stream)
        phase.write_input("cache_lens", step.cache_lens, self.stream)
        return phase, {"nb": len(seq_ids), "blk": blk, "pages": kv.num_pages, "maxp": kv.pages_per_seq}

    def _check_proposal(self, seq_ids: Sequence[int], anchors: Sequence[int]) -> None:
        nb = len(seq_ids)
        if not 1 <= nb <= self.manifest.options.max_batch:
            raise ValueError(f"propose takes 1 to {self.manifest.options.max_batch} sequences, got {nb}")
        if len(anchors) != nb:
            raise ValueError(f"propose: expected one anchor per sequence ({nb}), found {len(anchors)}")

    def _drafts(self, dims: Mapping[str, int], nb: int) -> Drafts:
        """The proposal's outputs, once the stream has computed them."""
        phase = self.phases["propose"]
        outputs = dict(phase.plan.outputs)
        tokens = phase.read_value(outputs["tokens"], dims, np.int32, self.stream)
        conf = None
        if "confidences" in outputs:
            conf = phase.read_value(outputs["confidences"], dims, np.float32, self.stream).reshape(nb, dims["blk"] - 1)
        return Drafts(tokens.reshape(nb, dims["blk"] - 1), conf)

    def close(self) -> None:
        self.graphs.close()
        for phase in self.phases.values():
            phase.close()
        for pointer in self._owned:
            self.device.free(pointer)
        self._owned.clear()
        self.stream.destroy()


def _device_address(name: str, value: Any, manifest: Manifest) -> int:
    """A device pointer from an int or a device tensor (DLPack / CUDA array interface), checked against the
    manifest's record of that weight."""
    if name not in manifest.weights:
        raise ArtifactError(
            f"external weight {name!r} is not a weight of this artifact; known: {sorted(manifest.weights)}"
        )
    if isinstance(value, int):
        return value
    record = manifest.weights[name]
    array = device_array(value)
    array.check(f"external weight {name}", record.shape, record.dtype)
    return array.pointer
