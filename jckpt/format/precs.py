"""The element-type table: header `prec` names <-> numpy / ml_dtypes dtypes.

Every stored element takes its numpy itemsize, little-endian. `Uint4x32_prec`
(OCANNL's 128-bit random-key element) reads as `uint32` with a trailing dim
of 4; `Void_prec` parses but cannot be loaded.

>>> dtype_of('Bfloat16_prec')
dtype(bfloat16)
>>> prec_of(np.dtype('float32'))
'Single_prec'
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

_TABLE: dict[str, object] = {
    'Byte_prec': np.uint8,
    'Uint16_prec': np.uint16,
    'Int32_prec': np.int32,
    'Uint32_prec': np.uint32,
    'Int64_prec': np.int64,
    'Uint64_prec': np.uint64,
    'Half_prec': np.float16,
    'Bfloat16_prec': ml_dtypes.bfloat16,
    'Fp8_prec': ml_dtypes.float8_e5m2,
    'Single_prec': np.float32,
    'Double_prec': np.float64,
    'Bool_prec': np.bool_,
    'Int8_prec': np.int8,
    'Int16_prec': np.int16,
    'Complex64_prec': np.complex64,
    'Complex128_prec': np.complex128,
    'Fp8e4m3fn_prec': ml_dtypes.float8_e4m3fn,
    'Fp8e4m3fnuz_prec': ml_dtypes.float8_e4m3fnuz,
    'Fp8e5m2fnuz_prec': ml_dtypes.float8_e5m2fnuz,
    'Fp8e4m3b11fnuz_prec': ml_dtypes.float8_e4m3b11fnuz,
    'Fp8e3m4_prec': ml_dtypes.float8_e3m4,
    'Fp8e4m3_prec': ml_dtypes.float8_e4m3,
    'Fp8e8m0fnu_prec': ml_dtypes.float8_e8m0fnu,
    'Fp4e2m1fn_prec': ml_dtypes.float4_e2m1fn,
    'Int4_prec': ml_dtypes.int4,
    'Uint4_prec': ml_dtypes.uint4,
    'Int2_prec': ml_dtypes.int2,
    'Uint2_prec': ml_dtypes.uint2,
}

#: Precs that OCANNL itself defines; files limited to these are OCANNL-readable.
OCANNL_PRECS = frozenset({
    'Byte_prec', 'Uint16_prec', 'Int32_prec', 'Uint32_prec', 'Int64_prec', 'Uint64_prec',
    'Uint4x32_prec', 'Half_prec', 'Bfloat16_prec', 'Fp8_prec', 'Single_prec',
    'Double_prec', 'Void_prec',
})

UINT4X32 = 'Uint4x32_prec'
VOID = 'Void_prec'

_DTYPES: dict[str, np.dtype] = {name: np.dtype(t).newbyteorder('<') for name, t in _TABLE.items()}
_DTYPES[UINT4X32] = np.dtype('<u4')
_PRECS: dict[np.dtype, str] = {np.dtype(t): name for name, t in _TABLE.items()}

#: Every prec name a reader accepts.
ALL_PRECS = frozenset(_DTYPES) | {VOID}


def dtype_of(prec: str) -> np.dtype:
    """The little-endian numpy dtype stored for `prec` (KeyError if unknown)."""
    return _DTYPES[prec]


def element_size(prec: str) -> int:
    """Bytes per stored element (16 for `Uint4x32_prec`, 0 for `Void_prec`)."""
    if prec == UINT4X32:
        return 16
    if prec == VOID:
        return 0
    return _DTYPES[prec].itemsize


def prec_of(dtype: np.dtype | type) -> str:
    """The prec name for a numpy dtype of any byte order (KeyError if none)."""
    dt = np.dtype(dtype)
    if dt.byteorder in ('<', '>'):
        dt = dt.newbyteorder('=')
    return _PRECS[dt]


def is_supported(dtype: np.dtype | type) -> bool:
    """Whether arrays of `dtype` can be stored."""
    try:
        prec_of(dtype)
    except (KeyError, TypeError):
        return False
    return True
