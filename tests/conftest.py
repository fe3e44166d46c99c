"""Shared fixtures and the GPU marker: GPU tests are skipped where no CUDA device is usable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def _cuda_device_present() -> bool:
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if int(err) != 0:
            return False
        err, count = driver.cuDeviceGetCount()
    except Exception:  # no cuda-python, or no driver library on a CPU-only box
        return False
    return int(err) == 0 and count > 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not _cuda_device_present():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU with cuda-python (run on the device machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def example_raw():
    """Load a bundled example's config.json as a dict (a fresh copy each call)."""

    def load(name: str) -> dict:
        return json.loads((EXAMPLES / name / "config.json").read_text())

    return load


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kernel-bundle",
        action="append",
        default=[],
        help="check bundle(s) written by `bench/kernels.py build` to run in tests/gpu (repeatable)",
    )
    parser.addoption(
        "--artifact",
        action="append",
        default=[],
        help="artifact(s) of bundled examples, without weights, to pack and run in tests/gpu (repeatable)",
    )
