"""Every kernel of a check bundle on the GPU against its spec's numpy reference.

Bundles are built on the build box (`python bench/kernels.py build DRAFTER --target sm_90 -o DIR`) and
passed with `--kernel-bundle DIR`; without one there is nothing to run here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def _cases(config: pytest.Config) -> list[tuple[str, int]]:
    from dflash_compiler.kernel_check import load_bundle

    out = []
    for directory in config.getoption("--kernel-bundle"):
        bundle = load_bundle(Path(directory))
        out += [(directory, i) for i in range(len(bundle.cases))]
    return out


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "bundle_case" in metafunc.fixturenames:
        cases = _cases(metafunc.config)
        metafunc.parametrize("bundle_case", cases, ids=[f"{Path(d).name}-{i}" for d, i in cases])


@pytest.fixture(scope="module")
def gpu():
    from dflash_compiler.runtime.cuda import Device

    return Device()


_modules: dict[str, object] = {}


def test_kernel_matches_numpy(gpu, bundle_case):
    from dflash_compiler.kernel_check import load_bundle, run_case
    from dflash_compiler.runtime.cuda import Module

    directory, index = bundle_case
    bundle = load_bundle(Path(directory))
    if directory not in _modules:
        _modules[directory] = Module(bundle.cubin)
    case = bundle.cases[index]
    result = run_case(
        gpu, _modules[directory], bundle.functions[case.kernel], bundle.specs[case.kernel], case, repeats=0
    )
    assert not result.problems, "\n".join(result.problems)
