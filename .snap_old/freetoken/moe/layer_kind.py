"""MoE layer kinds: what a layer's CPU and PCIe bandwidth depend on, and their row keys.

A kind is the CPU format of the layer's experts (with its options), the expert shape and top-k;
a bandwidth profile row is keyed by the kind plus the CPU worker count,
``<cpu format>[<options>]:<hidden>x<moe_intermediate>:top<k>:t<threads>``, e.g.
``gguf[down_type=8,gate_up_type=8]:2816x704:top8:t12`` or ``bf16:2048x768:top8:t15``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from freetoken.config import ModelConfig
from freetoken.errors import CheckpointError
from freetoken.quant import format_for_gguf_type, get_format

if TYPE_CHECKING:
    from freetoken.checkpoint import Checkpoint

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

Options = tuple[tuple[str, str], ...]

_TOKEN = re.compile(r"[A-Za-z0-9_.+-]+")
_KEY = re.compile(r"([A-Za-z0-9_.+-]+)(?:\[([^\]]*)\])?:(\d+)x(\d+):top(\d+):t(\d+)")
# stacked (GGUF, HF v5) or per-expert (HF) expert tensors, under our names
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp\.)?experts\.(?:\d+\.)?(gate_proj|up_proj|down_proj|gate_up_proj)"
    r"(?:\.weight)?"
)
# The CPU path keeps f16 and f32 experts as bf16, so they bench and key as bf16.
_CPU_FLOAT = {"f16": "bf16", "f32": "bf16"}


@dataclass(frozen=True)
class LayerKind:
    """What an MoE layer's CPU and PCIe bandwidth depend on, apart from the thread count.

    ``fmt`` is the CPU format (``gguf``, ``bf16``, ``fp8_block``, ``nvfp4``, ...); ``options``
    are sorted, unique ``(name, value)`` string pairs. ``moe_intermediate`` is the full
    intermediate size, not the per tensor-parallel rank one.
    """

    fmt: str
    hidden: int
    moe_intermediate: int
    top_k: int
    options: Options = ()

    def __post_init__(self) -> None:
        names = [k for k, _ in self.options]
        tokens = [self.fmt, *names, *(v for _, v in self.options)]
        if not all(isinstance(t, str) and _TOKEN.fullmatch(t) for t in tokens):
            raise ValueError(f"layer kind {self.fmt!r} {self.options!r}: format and options "
                             "must be words of letters, digits and _.+-")
        if names != sorted(set(names)):
            raise ValueError(f"layer kind options {self.options!r} must be sorted and unique")
        if min(self.hidden, self.moe_intermediate, self.top_k) < 1:
            raise ValueError(f"layer kind {self.fmt}: hidden, moe_intermediate and top_k must "
                             "be positive")

    def key(self, threads: int) -> str:
        """The profile row key of this kind benched with ``threads`` CPU workers."""
        opts = f"[{','.join(f'{k}={v}' for k, v in self.options)}]" if self.options else ""
        return (f"{self.fmt}{opts}:{self.hidden}x{self.moe_intermediate}:top{self.top_k}"
                f":t{threads}")


def parse_key(key: str) -> tuple[LayerKind, int]:
    """``(kind, threads)`` of a row key; ValueError naming the key if it is not canonical."""
    bad = (f"bad bandwidth profile key {key!r} (want "
           "<cpu format>[<options>]:<hidden>x<moe_intermediate>:top<k>:t<threads>)")
    m = _KEY.fullmatch(key)
    if m is None:
        raise ValueError(bad)
    fmt, opts, hidden, inter, top_k, threads = m.groups()
    options: list[tuple[str, str]] = []
    for item in (opts.split(",") if opts else []):
        name, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{bad}: option {item!r} is not name=value")
        options.append((name, value))
    try:
        kind = LayerKind(fmt, int(hidden), int(inter), int(top_k), tuple(options))
    except ValueError as e:
        raise ValueError(f"{bad}: {e}") from None
    t = int(threads)
    if t < 1:
        raise ValueError(f"{bad}: the thread count must be positive")
    if kind.key(t) != key:
        raise ValueError(f"{bad}: write it as {kind.key(t)!r}")
    return kind, t


def cpu_format(gate: str, up: str, down: str) -> tuple[str, Options]:
    """CPU format and options of a layer whose expert projections have these weight formats.

    GGUF block formats (q8_0, q4_k, mxfp4, ...) make ``gguf`` with the GGML type ids as options
    (``down_type``, ``gate_up_type``; ``gate_type`` and ``up_type`` if gate and up differ).
    Otherwise one format for all three is its own name (f16 and f32 count as bf16); anything
    else is ``mixed`` with the format names as options.
    """
    names = tuple(_CPU_FLOAT.get(f, f) for f in (gate, up, down))
    fmts = [get_format(n) for n in names]
    types = [f.gguf_type for f in fmts]
    if any(f.block_size > 1 and f.gguf_type is not None for f in fmts) and None not in types:
        g, u, d = types
        split = {"gate_up_type": g} if g == u else {"gate_type": g, "up_type": u}
        return "gguf", _options({"down_type": d, **split})
    if len(set(names)) == 1:
        return names[0], ()
    return "mixed", _options(dict(zip(("gate", "up", "down"), names, strict=True)))


def _options(values: Mapping[str, object]) -> Options:
    return tuple(sorted((k, str(v)) for k, v in values.items()))


def layer_kinds(ckpt: Checkpoint) -> dict[LayerKind, list[int]]:
    """Each MoE layer kind of a checkpoint and its layer indices, ascending.

    Reads only tensor formats (``tensor_infos()``): no weight is read.
    """
    if not ckpt.config.is_moe:
        return {}
    seen: dict[int, dict[str, set[str]]] = {}
    for t in ckpt.tensor_infos():
        m = _EXPERT.fullmatch(t.name)
        if m is None:
            continue
        targets = ("gate_proj", "up_proj") if m.group(2) == "gate_up_proj" else (m.group(2),)
        for proj in targets:
            seen.setdefault(int(m.group(1)), {}).setdefault(proj, set()).add(
                _CPU_FLOAT.get(t.fmt, t.fmt))
    formats: dict[int, dict[str, str]] = {}
    for layer, projs in seen.items():
        for proj, fmts in projs.items():
            if len(fmts) > 1:
                raise CheckpointError(
                    f"{ckpt.path}: layer {layer} {proj} has experts in several formats "
                    f"({', '.join(sorted(fmts))}); the CPU path needs one format per projection"
                )
        formats[layer] = {proj: next(iter(fmts)) for proj, fmts in projs.items()}
    return layer_kinds_from_formats(ckpt.config, formats, source=ckpt.path)


def layer_kinds_from_formats(
    config: ModelConfig, formats_by_layer: Mapping[int, Mapping[str, str]],
    source: str | Path | None = None,
) -> dict[LayerKind, list[int]]:
    """Group the MoE layers of ``config`` by kind; ``formats_by_layer[layer][proj]`` is the weight
    format of ``gate_proj``, ``up_proj`` and ``down_proj``. A missing one is a CheckpointError."""
    kinds: dict[LayerKind, list[int]] = {}
    for layer, is_moe in enumerate(config.moe_layers):
        if not is_moe:
            continue
        projs = formats_by_layer.get(layer, {})
        missing = [p for p in PROJECTIONS if p not in projs]
        if missing:
            raise CheckpointError(f"{source or 'checkpoint'}: MoE layer {layer} has no expert "
                                  f"tensor for {', '.join(missing)}; the checkpoint is incomplete")
        fmt, options = cpu_format(*(projs[p] for p in PROJECTIONS))
        kind = LayerKind(fmt, config.hidden_size, config.moe_intermediate_size, config.top_k,
                         options)
        kinds.setdefault(kind, []).append(layer)
    return kinds


def layer_span(layers: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2, 5, 7-8``."""
    runs: list[list[int]] = []
    for i in sorted(layers):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def kind_formats(kind: LayerKind) -> tuple[str, str, str]:
    """The weight formats of a kind's gate, up and down projections."""
    opts = dict(kind.options)
    if kind.fmt == "gguf":
        def name(t: str) -> str:
            return format_for_gguf_type(int(t)).name

        return (name(opts.get("gate_up_type", opts.get("gate_type", "0"))),
                name(opts.get("gate_up_type", opts.get("up_type", "0"))),
                name(opts["down_type"]))
    if kind.fmt == "mixed":
        return opts["gate"], opts["up"], opts["down"]
    return kind.fmt, kind.fmt, kind.fmt


def kind_words(kind: LayerKind) -> str:
    """The expert formats of a kind in words, as a bank names them (``q8_0``, ``gate/up q4_k,
    down q6_k``)."""
    return formats_in_words(*kind_formats(kind))


def formats_in_words(gate: str, up: str, down: str) -> str:
    """``q8_0`` when the three projections share a format, ``gate/up q4_k, down q6_k`` when
    gate and up do, else ``gate/up/down``."""
    if gate == up == down:
        return gate
    return f"gate/up {gate}, down {down}" if gate == up else f"{gate}/{up}/{down}"

