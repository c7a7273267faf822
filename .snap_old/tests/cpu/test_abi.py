"""The C ABI is checked at load: the built library's own answers (version, enum names, blocks,
struct sizes) against what freetoken/cpu/abi.py mirrors, and a mismatch on our side of any of
them is refused with a message that names it and says how to rebuild."""

from __future__ import annotations

import ctypes

import pytest

from freetoken.cpu import abi, library
from freetoken.quant import get_format

pytestmark = pytest.mark.skipif(library.available() is not None,
                                reason=str(library.available()))


@pytest.fixture
def lib() -> ctypes.CDLL:
    return library.native()


def test_the_built_library_matches_this_package(lib) -> None:
    assert abi.mismatches(lib) == []
    block, nbytes = ctypes.c_int(), ctypes.c_int()
    for i, fmt in enumerate(abi.FORMATS):  # the library's table is the quant formats' table
        assert lib.ft_format_info(i, ctypes.byref(block), ctypes.byref(nbytes)).decode() == fmt
        assert (block.value, nbytes.value) == (get_format(fmt).block_size,
                                               get_format(fmt).block_bytes)
    assert lib.ft_format_info(len(abi.FORMATS), ctypes.byref(block), ctypes.byref(nbytes)) \
        is None
    assert lib.ft_struct_size(b"NoSuchStruct") == -1


class _WiderStep(ctypes.Structure):
    _fields_ = [*abi.DecodeStep._fields_, ("extra", ctypes.c_int64)]


@pytest.mark.parametrize("name, value, message", [
    ("ABI_VERSION", abi.ABI_VERSION + 1,
     f"its ABI version is {abi.ABI_VERSION}, this package's is {abi.ABI_VERSION + 1}"),
    ("FORMATS", ("q8_0", "bf16", *abi.FORMATS[2:]), "its formats are bf16, q8_0"),
    ("ISAS", abi.ISAS[:-1], "its ISA tiers are scalar, avx2, avx512, avx512_vnni, avx512_bf16"),
    ("ACT_KINDS", ("q8", "f32", "bf16"), "its activation kinds are f32, q8, bf16"),
    ("TIMING_FIELDS", abi.TIMING_FIELDS + 1, "its timing record has 10 fields; ours 11"),
    ("WORKER_FIELDS", (*abi.WORKER_FIELDS, "extra"), "its worker record has 5 fields; ours 6"),
])
def test_each_mismatch_is_named(lib, monkeypatch, name, value, message) -> None:
    monkeypatch.setattr(abi, name, value)
    assert any(message in m for m in abi.mismatches(lib)), abi.mismatches(lib)


def test_a_struct_of_another_size_is_named(lib, monkeypatch) -> None:
    _WiderStep.__name__ = "DecodeStep"
    monkeypatch.setattr(abi, "STRUCTS", (abi.ProjDesc, abi.DecodeLayer, _WiderStep))
    want = f"its DecodeStep takes {ctypes.sizeof(abi.DecodeStep)} bytes; ours " \
           f"{ctypes.sizeof(_WiderStep)}"
    assert want in abi.mismatches(lib)


def test_loading_a_mismatched_library_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(abi, "ABI_VERSION", abi.ABI_VERSION + 1)
    library.native.cache_clear()
    try:
        with pytest.raises(library.NativeUnavailable,
                           match=r"built from other sources than this package \(its ABI "
                                 r"version is \d+, this package's is \d+\); rebuild it with "
                                 r"`pip install -e \.`"):
            library.native()
        assert "built from other sources" in (library.available() or "")
    finally:
        library.native.cache_clear()
