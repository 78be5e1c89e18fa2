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

import functools

import numpy as np

#: The precs of numpy's own dtypes.
_NUMPY: dict[str, type] = {
    'Byte_prec': np.uint8,
    'Uint16_prec': np.uint16,
    'Int32_prec': np.int32,
    'Uint32_prec': np.uint32,
    'Int64_prec': np.int64,
    'Uint64_prec': np.uint64,
    'Half_prec': np.float16,
    'Single_prec': np.float32,
    'Double_prec': np.float64,
    'Bool_prec': np.bool_,
    'Int8_prec': np.int8,
    'Int16_prec': np.int16,
    'Complex64_prec': np.complex64,
    'Complex128_prec': np.complex128,
}

#: The precs of ml_dtypes' types: `(its name in ml_dtypes, bytes per element)`. ml_dtypes is
#: imported when one of them is first turned into a dtype, not with the codec: its import
#: costs most of `import jckpt`'s time, and reading a header (`jckpt inspect`, a manager
#: listing its steps) needs only the names and sizes.
_ML_DTYPES: dict[str, tuple[str, int]] = {
    'Bfloat16_prec': ('bfloat16', 2),
    'Fp8_prec': ('float8_e5m2', 1),
    'Fp8e4m3fn_prec': ('float8_e4m3fn', 1),
    'Fp8e4m3fnuz_prec': ('float8_e4m3fnuz', 1),
    'Fp8e5m2fnuz_prec': ('float8_e5m2fnuz', 1),
    'Fp8e4m3b11fnuz_prec': ('float8_e4m3b11fnuz', 1),
    'Fp8e3m4_prec': ('float8_e3m4', 1),
    'Fp8e4m3_prec': ('float8_e4m3', 1),
    'Fp8e8m0fnu_prec': ('float8_e8m0fnu', 1),
    'Fp4e2m1fn_prec': ('float4_e2m1fn', 1),
    'Int4_prec': ('int4', 1),
    'Uint4_prec': ('uint4', 1),
    'Int2_prec': ('int2', 1),
    'Uint2_prec': ('uint2', 1),
}

#: Precs that OCANNL itself defines; files limited to these are OCANNL-readable.
OCANNL_PRECS = frozenset({
    'Byte_prec', 'Uint16_prec', 'Int32_prec', 'Uint32_prec', 'Int64_prec', 'Uint64_prec',
    'Uint4x32_prec', 'Half_prec', 'Bfloat16_prec', 'Fp8_prec', 'Single_prec',
    'Double_prec', 'Void_prec',
})

UINT4X32 = 'Uint4x32_prec'
VOID = 'Void_prec'

_SIZES: dict[str, int] = ({name: np.dtype(t).itemsize for name, t in _NUMPY.items()}
                          | {name: size for name, (_, size) in _ML_DTYPES.items()})

#: Every prec name a reader accepts.
ALL_PRECS = frozenset(_SIZES) | {UINT4X32, VOID}


@functools.cache
def _tables() -> tuple[dict[str, np.dtype], dict[np.dtype, str]]:
    """prec -> little-endian dtype, and native dtype -> prec (ml_dtypes imported here)."""
    import ml_dtypes

    types = dict(_NUMPY) | {name: getattr(ml_dtypes, attr) for name, (attr, _) in _ML_DTYPES.items()}
    dtypes = {name: np.dtype(t).newbyteorder('<') for name, t in types.items()}
    dtypes[UINT4X32] = np.dtype('<u4')
    return dtypes, {np.dtype(t): name for name, t in types.items()}


def dtype_of(prec: str) -> np.dtype:
    """The little-endian numpy dtype stored for `prec` (KeyError if unknown)."""
    return _tables()[0][prec]


def dtype_name(prec: str) -> str:
    """numpy's name of `prec`'s dtype, as `dtype_of(prec).name` says it ('void' for
    `Void_prec`), without importing ml_dtypes (KeyError if unknown).

    >>> dtype_name('Bfloat16_prec'), dtype_name('Single_prec'), dtype_name('Void_prec')
    ('bfloat16', 'float32', 'void')
    """
    if prec in (VOID, UINT4X32):
        return 'void' if prec == VOID else 'uint32'
    return _ML_DTYPES[prec][0] if prec in _ML_DTYPES else np.dtype(_NUMPY[prec]).name


def element_size(prec: str) -> int:
    """Bytes per stored element (16 for `Uint4x32_prec`, 0 for `Void_prec`)."""
    if prec == UINT4X32:
        return 16
    if prec == VOID:
        return 0
    return _SIZES[prec]


def item_size(prec: str) -> int:
    """`dtype_of(prec).itemsize` without importing ml_dtypes: `element_size`, but 4 for
    `Uint4x32_prec` (an element of it is four `uint32`s)."""
    return 4 if prec == UINT4X32 else element_size(prec)


def prec_of(dtype: np.dtype | type) -> str:
    """The prec name for a numpy dtype of any byte order (KeyError if none)."""
    dt = np.dtype(dtype)
    if dt.byteorder in ('<', '>'):
        dt = dt.newbyteorder('=')
    return _tables()[1][dt]


def is_supported(dtype: np.dtype | type) -> bool:
    """Whether arrays of `dtype` can be stored."""
    try:
        prec_of(dtype)
    except (KeyError, TypeError):
        return False
    return True
