"""A readable summary of a validated drafter (what `dflash-compile validate` prints)."""

from __future__ import annotations

from dflash_compiler.config import DrafterConfig
from dflash_compiler.tensors import expected_drafter_tensors, parameter_count


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _layer_kinds(cfg: DrafterConfig) -> str:
    groups: list[tuple[str, int]] = []
    for layer in cfg.layers:
        text = layer.describe()
        if groups and groups[-1][0] == text:
            groups[-1] = (text, groups[-1][1] + 1)
        else:
            groups.append((text, 1))
    return "; ".join(f"{n}x {text}" for text, n in groups)


def config_rows(cfg: DrafterConfig) -> list[tuple[str, str]]:
    """(label, value) rows describing the drafter config."""
    params = parameter_count(cfg)
    rows = [
        ("family", f"{cfg.family.value} ({cfg.architecture})"),
        ("layers", f"{cfg.num_layers}: {_layer_kinds(cfg)}"),
        ("hidden / intermediate", f"{cfg.hidden_size} / {cfg.intermediate_size}"),
        ("heads (q / kv) x head_dim", f"{cfg.num_heads} / {cfg.num_kv_heads} x {cfg.head_dim}"),
        ("vocabulary (target)", f"{cfg.vocab_size}, mask token {cfg.mask_token_id}"),
        (
            "target taps",
            f"{list(cfg.target_layer_ids)} of {cfg.num_target_layers} layers"
            + (" (default)" if cfg.target_layer_ids_defaulted else "")
            + f", fc {cfg.fc_in_features} -> {cfg.hidden_size}",
        ),
        ("block size / drafts (gamma)", f"{cfg.block_size} / {cfg.gamma}"),
        ("RoPE", cfg.rope.describe()),
        ("tensors", str(len(expected_drafter_tensors(cfg)))),
        ("parameters", f"{params:,} ({human_bytes(params * 2)} in bf16)"),
        ("KV per context row", f"{human_bytes(cfg.kv_bytes_per_token)} (bf16, all layers)"),
    ]
    extras = []
    if cfg.output_multiplier != 1.0:
        extras.append(f"output_multiplier {cfg.output_multiplier:g}")
    if cfg.final_logit_softcapping is not None:
        extras.append(f"softcap {cfg.final_logit_softcapping:g}")
    if cfg.input_embedding_scale != 1.0:
        extras.append(f"input_embedding_scale {cfg.input_embedding_scale:g}")
    if extras:
        rows.append(("logit / embedding transforms", ", ".join(extras)))
    if cfg.dflash2 is not None:
        d = cfg.dflash2
        rows.append(
            (
                "DFlash2",
                f"conv K={d.conv_kernel_size} group={d.conv_group_size}; "
                f"selector rank={d.selector_rank} top_k={d.selector_top_k}",
            )
        )
    if cfg.dspark is not None:
        s = cfg.dspark
        rows.append(
            (
                "DSpark",
                f"Markov {s.markov_head_type.value} rank={s.markov_rank}; confidence head "
                + (
                    "on" + (" (with Markov)" if s.confidence_head_with_markov else "")
                    if s.enable_confidence_head
                    else "off"
                ),
            )
        )
    rows.append(("unknown keys (kept)", ", ".join(cfg.unknown_keys) if cfg.unknown_keys else "none"))
    rows.extend(("note", note) for note in cfg.notes)
    return rows
