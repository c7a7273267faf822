"""The C ABI of the CPU library as this package expects it, and the check that the loaded
library matches.

What crosses the boundary by number or by layout is written here once: the enums' names in
number order (:data:`FORMATS`, :data:`ISAS`, :data:`ACT_KINDS`), the structs Python fills
(:class:`ProjDesc`, :class:`GluDesc`, :class:`DecodeLayer`, :class:`DecodeStep`,
:class:`RowCopyApi`, :class:`RowCopy`), the length of a job's timing record and the ABI
version. :func:`mismatches` asks the library for each and lists what
differs, so a library built from other sources is refused with its reason instead of being
called with the wrong numbers. Blocks come from the quant formats' table (``freetoken/quant``),
which the library's own table must equal.
"""

from __future__ import annotations

import ctypes as c

from freetoken.quant import get_format

ABI_VERSION = 19  # csrc/common.h ABI_VERSION
ISAS = ("scalar", "avx2", "avx512", "avx512_vnni", "avx512_bf16")  # lowest tier first
FORMATS = ("bf16", "q8_0", "q4_0", "q5_0", "q4_k", "q5_k", "q6_k", "mxfp4", "nvfp4", "fp8_block",
           "f32")
# What experts are kept in: f32 and f16 experts are kept as bf16; f32 is for dense routers.
EXPERT_FORMATS = FORMATS[:-1]
ACT_KINDS = ("f32", "q8", "bf16")  # how a kernel reads activations
TIMING_FIELDS = 10  # int64s of a job's timing record (csrc TimingField)
# A pool worker's record (csrc/thread_pool.h WorkerField) and its states by number.
WORKER_FIELDS = ("state", "phase", "for_ns", "jobs", "items")
WORKER_STATES = ("waiting (spinning)", "waiting (asleep)", "running a job",
                 "between phases (spinning)", "between phases (asleep)", "stopped")


class ProjDesc(c.Structure):
    """csrc/capi.cpp ProjDesc: one projection of every expert of a layer."""

    _fields_ = [
        ("fmt", c.c_int32),
        ("rows", c.c_int64),
        ("cols", c.c_int64),
        ("data", c.c_void_p),
        ("row_bytes", c.c_int64),
        ("scale", c.c_void_p),
        ("scale_row_bytes", c.c_int64),
        ("scale2", c.c_void_p),
        ("expert_bytes", c.c_int64),
    ]


class GluDesc(c.Structure):
    """csrc/capi.cpp GluDesc: the clamped SwiGLU's parameters and a layer's expert biases
    (float32, (E, I), (E, I), (E, H); null where the experts have none)."""

    _fields_ = [("alpha", c.c_float), ("limit", c.c_float), ("gate_bias", c.c_void_p),
                ("up_bias", c.c_void_p), ("down_bias", c.c_void_p)]


class DecodeLayer(c.Structure):
    """csrc/decode_layer.h DecodeLayer: what one layer of the native CPU decode reads."""

    _fields_ = [
        ("input_norm", c.c_void_p), ("post_norm", c.c_void_p), ("q_norm", c.c_void_p),
        ("k_norm", c.c_void_p), ("eps", c.c_float), ("qkv", c.c_int32), ("o", c.c_int32),
        ("router", c.c_int32), ("moe", c.c_int32), ("H", c.c_int32), ("Hq", c.c_int32),
        ("Hkv", c.c_int32), ("D", c.c_int32), ("E", c.c_int32), ("A", c.c_int32),
        ("renormalise", c.c_int32), ("scale", c.c_float), ("k_cache", c.c_void_p),
        ("v_cache", c.c_void_p), ("cos", c.c_void_p), ("sin", c.c_void_p), ("P", c.c_int64),
        ("unit_offset", c.c_int32), ("windowed", c.c_int32), ("attn_out_norm", c.c_void_p),
        ("ffn_out_norm", c.c_void_p), ("q", c.c_int32), ("k", c.c_int32), ("v", c.c_int32),
        ("gate_up", c.c_int32), ("down", c.c_int32), ("I", c.c_int32), ("act", c.c_int32),
    ]


class DecodeStep(c.Structure):
    """csrc/decode_layer.h DecodeStep: what every layer of one decode step shares."""

    _fields_ = [
        ("positions", c.c_void_p), ("new_slots", c.c_void_p), ("slots", c.c_void_p),
        ("visible", c.c_void_p), ("B", c.c_int32), ("S", c.c_int32),
        ("visible_window", c.c_void_p),
    ]


class RowCopyApi(c.Structure):
    """csrc/row_copy.h RowCopyApi: the CUDA driver's entry points (all None: memcpy)."""

    _fields_ = [("memcpy_async", c.c_void_p), ("event_record", c.c_void_p),
                ("stream_wait_event", c.c_void_p), ("event_query", c.c_void_p),
                ("event_synchronize", c.c_void_p)]


class RowCopy(c.Structure):
    """csrc/row_copy.h RowCopy: rows of one buffer copied into rows of another."""

    _fields_ = [
        ("dst", c.c_void_p), ("dst_stride", c.c_int64), ("src", c.c_void_p),
        ("src_stride", c.c_int64), ("row_bytes", c.c_int64), ("dst_rows", c.c_void_p),
        ("src_rows", c.c_void_p), ("n", c.c_int32), ("compute_waits", c.c_int32),
        ("compute_stream", c.c_void_p), ("copy_stream", c.c_void_p), ("ev_ready", c.c_void_p),
        ("ev_start", c.c_void_p), ("ev_end", c.c_void_p),
    ]


class HostNodeStep(c.Structure):
    """csrc/host_node.h HostNodeStep: what one decode graph's host nodes share."""

    _fields_ = [("rows", c.c_int64), ("failures", c.c_int64), ("last_error", c.c_int64),
                ("core", c.c_int64)]


class HostNodeJob(c.Structure):
    """csrc/host_node.h HostNodeJob: one layer's pool job as a graph's host node."""

    _fields_ = [
        ("ex", c.c_void_p), ("x", c.c_void_p), ("ids", c.c_void_p), ("w", c.c_void_p),
        ("out", c.c_void_p), ("layer", c.c_int32), ("T", c.c_int32), ("A", c.c_int32),
        ("pad", c.c_int32), ("step", c.POINTER(HostNodeStep)),
    ]


class FlagJobs(c.Structure):
    """csrc/graph_flags.h FlagJobs: one graph piece's pool jobs, served on pinned flags."""

    _fields_ = [
        ("jobs", c.POINTER(HostNodeJob)), ("go", c.c_void_p), ("done", c.c_void_p),
        ("first", c.c_int32), ("n", c.c_int32), ("spin_us", c.c_int32),
        ("timeout_ms", c.c_int32), ("served", c.c_int32), ("pad", c.c_int32),
    ]


class FetchRule(c.Structure):
    """csrc/layer_call.h FetchRule: how many of a call's misses to fetch (the split policy's
    count)."""

    _fields_ = [
        ("held", c.c_int32), ("online", c.c_int32), ("pcie_due", c.c_int32),
        ("cpu_due", c.c_int32), ("share", c.c_double), ("probe_share", c.c_double),
        ("max_fetch", c.c_int32), ("arrived", c.c_int32),
    ]


PROBINGS = ("", "pcie", "cpu")  # csrc/layer_call.h Probing, by value


class AheadRule(c.Structure):
    """csrc/layer_call.h AheadRule: how many predicted misses look-ahead fetches."""

    _fields_ = [("share", c.c_double), ("floor", c.c_double), ("max_fetch", c.c_int32),
                ("budget", c.c_int32)]


IN_PREDICTED, IN_FETCHED, IN_LISTS = 0, 1, 2  # csrc/layer_call.h IncomingAt


class Ahead(c.Structure):
    """csrc/layer_call.h Ahead: look-ahead for the next layer after a call's plan."""

    _fields_ = [
        ("slots", c.c_void_p), ("picks", c.c_void_p), ("layer", c.c_int32),
        ("n_picks", c.c_int32), ("same_pool", c.c_int32), ("experts", c.c_int32),
        ("incoming", c.c_void_p), ("copy", RowCopy), ("keep", c.c_void_p),
        ("predicted", c.c_void_p), ("slot", c.c_void_p), ("fetched", c.c_void_p),
        ("fetched_slots", c.c_void_p), ("dst_rows", c.c_void_p), ("src_rows", c.c_void_p),
        ("rule", AheadRule), ("ev_start", c.c_void_p), ("ev_end", c.c_void_p),
        ("n_predicted", c.c_int32), ("n_fetched", c.c_int32), ("copy_ns", c.c_int64),
    ]


class LayerCall(c.Structure):
    """csrc/layer_call.h LayerCall: an offloaded layer's decode call, planned in one call."""

    _fields_ = [
        ("slots", c.c_void_p), ("executor", c.c_void_p), ("api", c.POINTER(RowCopyApi)),
        ("copy", RowCopy), ("ids", c.c_void_p), ("layer", c.c_int32), ("rows", c.c_int32),
        ("top_k", c.c_int32), ("num_slots", c.c_int32), ("stream_above", c.c_int32),
        ("pad0", c.c_int32), ("x", c.c_void_p), ("w", c.c_void_p), ("cpu_out", c.c_void_p),
        ("cpu_signal", c.c_void_p), ("cpu_ids", c.c_void_p), ("needed", c.c_void_p),
        ("uses", c.c_void_p),
        ("slot", c.c_void_p), ("fetched", c.c_void_p), ("fetched_slots", c.c_void_p),
        ("dst_rows", c.c_void_p), ("src_rows", c.c_void_p), ("table", c.c_void_p),
        ("staged", c.c_void_p), ("device_table", c.c_uint64), ("table_bytes", c.c_int64),
        ("incoming", c.c_void_p), ("experts", c.c_int32), ("pad2", c.c_int32),
        ("ahead", Ahead), ("rule", FetchRule), ("wait_first", c.c_void_p), ("ev_start", c.c_void_p),
        ("ev_end", c.c_void_p), ("n_needed", c.c_int32), ("misses", c.c_int32),
        ("n_fetched", c.c_int32), ("n_cpu", c.c_int32), ("probing", c.c_int32),
        ("pad1", c.c_int32), ("ticket", c.c_int64), ("submit_ns", c.c_int64),
        ("copy_ns", c.c_int64), ("la_predicted", c.c_int32), ("la_used", c.c_int32),
    ]


STRUCTS: tuple[type[c.Structure], ...] = (ProjDesc, GluDesc, DecodeLayer, DecodeStep,
                                          RowCopyApi, RowCopy, HostNodeStep, HostNodeJob,
                                          FlagJobs, FetchRule, AheadRule, Ahead, LayerCall)
# The functions that describe the ABI, declared before anything else is looked up.
SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "ft_abi_version": (c.c_int, []),
    "ft_format_count": (c.c_int, []),
    "ft_format_info": (c.c_char_p, [c.c_int, c.POINTER(c.c_int), c.POINTER(c.c_int)]),
    "ft_isa_count": (c.c_int, []),
    "ft_isa_name": (c.c_char_p, [c.c_int]),
    "ft_act_count": (c.c_int, []),
    "ft_act_name": (c.c_char_p, [c.c_int]),
    "ft_struct_size": (c.c_int64, [c.c_char_p]),
    "ft_timing_fields": (c.c_int, []),
    "ft_worker_fields": (c.c_int, []),
}


def _names(lib: c.CDLL, count: str, name_of: str) -> tuple[str, ...]:
    fn = getattr(lib, name_of)
    return tuple(fn(i).decode() for i in range(getattr(lib, count)()))


def mismatches(lib: c.CDLL) -> list[str]:
    """What the loaded library (ABI functions declared) says differently from this module."""
    version = lib.ft_abi_version()
    if version != ABI_VERSION:
        return [f"its ABI version is {version}, this package's is {ABI_VERSION}"]
    out = []
    for what, ours, count, name_of in (("ISA tiers", ISAS, "ft_isa_count", "ft_isa_name"),
                                       ("activation kinds", ACT_KINDS, "ft_act_count",
                                        "ft_act_name")):
        theirs = _names(lib, count, name_of)
        if theirs != ours:
            out.append(f"its {what} are {', '.join(theirs)}; ours are {', '.join(ours)}")
    block, nbytes = c.c_int(), c.c_int()
    formats = []
    for i in range(lib.ft_format_count()):
        formats.append(lib.ft_format_info(i, c.byref(block), c.byref(nbytes)).decode())
        if i < len(FORMATS) and formats[-1] == FORMATS[i]:
            q = get_format(FORMATS[i])
            if (block.value, nbytes.value) != (q.block_size, q.block_bytes):
                out.append(f"its {FORMATS[i]} block is {block.value} weights in {nbytes.value} "
                           f"bytes; ours is {q.block_size} in {q.block_bytes}")
    if tuple(formats) != FORMATS:
        out.append(f"its formats are {', '.join(formats)}; ours are {', '.join(FORMATS)}")
    for struct in STRUCTS:
        size = lib.ft_struct_size(struct.__name__.encode())
        if size != c.sizeof(struct):
            out.append(f"its {struct.__name__} takes {size} bytes; ours {c.sizeof(struct)}")
    fields = lib.ft_timing_fields()
    if fields != TIMING_FIELDS:
        out.append(f"its timing record has {fields} fields; ours {TIMING_FIELDS}")
    fields = lib.ft_worker_fields()
    if fields != len(WORKER_FIELDS):
        out.append(f"its worker record has {fields} fields; ours {len(WORKER_FIELDS)}")
    return out
