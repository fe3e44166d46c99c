"""Target records and the registry: the numbers, the consistency checks, and every error path."""

from __future__ import annotations

import pydantic
import pytest

from dflash_compiler.targets import (
    DEFAULT_TARGET,
    SM90,
    SM120,
    SM121,
    TARGETS,
    Target,
    TargetError,
    device_compute_capability,
    get_target,
    known_targets,
    target_for_compute_capability,
)

KIB = 1024


@pytest.mark.parametrize(
    ("target", "arch", "cc", "sms", "smem", "smem_sm", "threads_sm", "bandwidth"),
    [
        (SM90, "sm_90a", (9, 0), 132, 227 * KIB, 228 * KIB, 2048, 4.8e12),
        (SM120, "sm_120a", (12, 0), 170, 99 * KIB, 100 * KIB, 1536, 1.792e12),
        (SM121, "sm_121a", (12, 1), 48, 99 * KIB, 100 * KIB, 1536, 273e9),
    ],
    ids=["sm_90", "sm_120", "sm_121"],
)
def test_record_numbers(target, arch, cc, sms, smem, smem_sm, threads_sm, bandwidth):
    assert target.arch == arch
    assert target.compute_capability == cc
    assert target.sm_count == sms
    assert target.max_shared_memory_per_block == smem
    assert target.shared_memory_per_sm == smem_sm
    assert target.max_threads_per_sm == threads_sm
    assert target.dram_bandwidth_bytes_per_s == pytest.approx(bandwidth)
    assert target.max_static_shared_memory_per_block == 48 * KIB
    assert (target.warp_size, target.max_threads_per_block) == (32, 1024)
    assert (target.registers_per_sm, target.max_registers_per_block, target.max_registers_per_thread) == (
        65536,
        65536,
        255,
    )
    assert target.fp8_mma and target.bf16_mma
    assert target.schedule_arch == arch.removesuffix("a")


def test_l2_sizes():
    assert (SM90.l2_bytes, SM120.l2_bytes, SM121.l2_bytes) == (50 * KIB * KIB, 96 * KIB * KIB, 24 * KIB * KIB)


def test_records_are_frozen():
    with pytest.raises(pydantic.ValidationError):
        SM90.sm_count = 1  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        Target(**{**SM90.model_dump(), "surprise": 1})


def test_records_round_trip_through_json():
    for target in TARGETS.values():
        assert Target.model_validate_json(target.model_dump_json()) == target


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"arch": "sm_90"}, "target.arch"),
        ({"arch": "sm_120a"}, "target.arch"),
        ({"name": "hopper"}, "target.name"),
        ({"compute_capability": (8, 9)}, "target.name"),
        ({"max_shared_memory_per_block": 300 * KIB}, "target.max_shared_memory_per_block"),
        ({"max_threads_per_block": 1000}, "target.max_threads_per_block"),
    ],
)
def test_inconsistent_records_are_refused(change, field):
    with pytest.raises(TargetError) as err:
        Target(**{**SM90.model_dump(), **change})
    assert field in str(err.value)


def test_tvm_target_dict_uses_schedule_arch_and_capabilities():
    d = SM120.tvm_target_dict()
    assert d["kind"] == "cuda"
    assert d["arch"] == "sm_120"  # dlight's check_sm_version cannot parse "120a"
    assert d["max_shared_memory_per_block"] == SM120.max_shared_memory_per_block
    assert d["max_threads_per_block"] == 1024
    assert d["thread_warp_size"] == 32
    assert d["l2_cache_size_bytes"] == SM120.l2_bytes


def test_tvm_target_builds():
    pytest.importorskip("tvm")
    t = SM90.tvm_target()
    assert t.kind.name == "cuda"
    assert str(t.attrs["arch"]) == "sm_90"
    assert int(t.attrs["max_shared_memory_per_block"]) == 227 * KIB


def test_registry_names():
    assert known_targets() == ("sm_90", "sm_120", "sm_121", "auto")
    assert DEFAULT_TARGET in TARGETS
    for name, target in TARGETS.items():
        assert get_target(name) is target
        assert target.name == name


@pytest.mark.parametrize("name", ["sm_90a", "h100", "SM_90", "", "sm_100"])
def test_unknown_name_lists_known_ones(name):
    with pytest.raises(TargetError) as err:
        get_target(name)
    message = str(err.value)
    assert repr(name) in message
    for known in known_targets():
        assert known in message


@pytest.mark.parametrize(("cc", "target"), [((9, 0), SM90), ((12, 0), SM120), ((12, 1), SM121)])
def test_auto_maps_compute_capability(cc, target):
    assert get_target("auto", probe=lambda: cc) is target
    assert target_for_compute_capability(cc) is target


@pytest.mark.parametrize("cc", [(8, 0), (8, 9), (10, 0), (12, 2)])
def test_auto_refuses_unsupported_devices(cc):
    with pytest.raises(TargetError) as err:
        get_target("auto", probe=lambda: cc)
    message = str(err.value)
    assert f"{cc[0]}.{cc[1]}" in message
    assert "9.0 (sm_90)" in message and "12.1 (sm_121)" in message
    assert "--target" in message


def test_auto_on_this_machine():
    """With a GPU, `auto` maps it (or names it unsupported); without one, the error says to pass --target."""
    try:
        cc = device_compute_capability()
    except TargetError as err:
        assert "pass an explicit --target" in str(err)
        with pytest.raises(TargetError, match="--target"):
            get_target("auto")
        return
    if cc in {t.compute_capability for t in TARGETS.values()}:
        assert get_target("auto").compute_capability == cc
    else:
        with pytest.raises(TargetError, match="compute capability"):
            get_target("auto")
