"""Compare a kernel's outputs with its spec's numpy reference (CPU tests and the GPU check share it)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .base import KernelSpec


def mismatches(
    spec: KernelSpec,
    got: Mapping[str, np.ndarray],
    ref: Mapping[str, np.ndarray],
    inputs: Mapping[str, np.ndarray] | None = None,
) -> list[str]:
    """One line per written parameter that is off: where, the values, the tolerance. Empty when all agree.

    `inputs` are the arrays the kernel ran on, for specs whose tolerance scales with them
    (`KernelSpec.error_scale`)."""
    problems: list[str] = []
    for p in spec.params():
        if not p.written:
            continue
        g, r = np.asarray(got[p.name]), np.asarray(ref[p.name])
        if g.shape != r.shape:
            problems.append(f"{spec.name}.{p.name}: shape {g.shape}, expected {r.shape}")
            continue
        if g.size == 0:
            continue
        if np.issubdtype(r.dtype, np.integer):
            bad = np.flatnonzero(g.astype(np.int64).ravel() != r.astype(np.int64).ravel())
            if bad.size:
                i = np.unravel_index(bad[0], r.shape)
                problems.append(
                    f"{spec.name}.{p.name}: {bad.size} of {r.size} differ; at {i} got {g[i]}, expected {r[i]}"
                )
            continue
        g64, r64 = g.astype(np.float64), r.astype(np.float64)
        if not np.all(np.isfinite(g64)):
            problems.append(f"{spec.name}.{p.name}: {int(np.sum(~np.isfinite(g64)))} non-finite values")
            continue
        tol = spec.tolerance(p.name)
        per_element = spec.error_scale(p.name, inputs)
        rms = float(np.sqrt(np.mean(r64 * r64)))
        scale = rms if per_element is None else np.broadcast_to(np.asarray(per_element, np.float64), r.shape)
        excess = np.abs(g64 - r64) - (tol.rtol * np.abs(r64) + tol.atol * scale)
        if np.any(excess > 0):
            i = np.unravel_index(int(np.argmax(excess)), r.shape)
            of = f"rms {rms:.3g}" if per_element is None else f"the error scale ({float(scale[i]):.3g} there)"
            problems.append(
                f"{spec.name}.{p.name}: {int(np.sum(excess > 0))} of {r.size} outside rtol {tol.rtol:g} + atol "
                f"{tol.atol:g} x {of}; worst at {i}: got {g64[i]:.6g}, expected {r64[i]:.6g}"
            )
    return problems


def max_relative_error(spec: KernelSpec, got: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray]) -> float:
    """max |got - ref| / rms(ref) over the float outputs (0 for integer-only kernels): the figure reports quote."""
    worst = 0.0
    for p in spec.params():
        r = np.asarray(ref[p.name]) if p.written else None
        if r is None or r.size == 0 or np.issubdtype(r.dtype, np.integer):
            continue
        r64, g64 = r.astype(np.float64), np.asarray(got[p.name]).astype(np.float64)
        rms = float(np.sqrt(np.mean(r64 * r64))) or 1.0
        worst = max(worst, float(np.max(np.abs(g64 - r64))) / rms)
    return worst
