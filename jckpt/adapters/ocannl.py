"""OCANNL files: jckpt's format restricted to what OCANNL's own reader accepts.

jckpt's file format is OCANNL's (`Ocannl.Persistence`, version 1), so any
OCANNL file reads with `jckpt.load`: padded entries, every OCANNL prec, the
legacy `""` namespace (read as `ocannl`). The other direction has limits:
OCANNL refuses precs it does not define (`Bool_prec`, `Int8_prec`, the
extra float8 types, ...) and headers over 100,000,000 bytes, and needs ids
unique within a namespace. `write` refuses the first before touching the
file, `problems` lists all of them for any file, and a header over the
limit is written with a warning.

>>> import numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), 'm.ckpt')
>>> write({'model': {'w': np.ones(3, np.float32)}}, path)
>>> problems(path)
[]
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from jckpt.adapters import native
from jckpt.adapters._common import check_namespaced, host_items, warn_key_data
from jckpt.errors import InputError
from jckpt.format import precs
from jckpt.format.header import OCANNL_HEADER_LIMIT, Header, path_name

#: OCANNL's reader refuses headers longer than this many bytes.
HEADER_LIMIT = OCANNL_HEADER_LIMIT

#: A cast that keeps every value, for each non-OCANNL dtype that has one.
_WIDEN = {'Bool_prec': 'uint8 (Byte_prec)', 'Int8_prec': 'int32 (Int32_prec)',
          'Int16_prec': 'int32 (Int32_prec)', 'Uint4_prec': 'uint8 (Byte_prec)',
          'Uint2_prec': 'uint8 (Byte_prec)', 'Int4_prec': 'int32 (Int32_prec)',
          'Int2_prec': 'int32 (Int32_prec)'}


def problems(source: str | os.PathLike | Header) -> list[str]:
    """What an OCANNL reader would refuse in a file (or header); empty when it reads it all.

    Checks: every prec is one OCANNL defines, ids are unique within each
    namespace, and the header is within OCANNL's 100,000,000-byte limit.
    """
    from jckpt.format.header import encode_header

    if isinstance(source, Header):
        header, hlen = source, len(encode_header(source)) - 4
    else:
        from jckpt.storage.reader import CheckpointReader
        reader = CheckpointReader(source)
        header, hlen = reader.header, reader.data_start - 4
    found = []
    seen: dict[tuple[str, int], str] = {}
    for e in header.tensors:
        if e.prec not in precs.OCANNL_PRECS:
            found.append(f"{e.name}: prec {e.prec} is not an OCANNL prec")
        key = (e.namespace, e.id)
        if key in seen:
            found.append(f"{e.name}: id {e.id} is also used by {seen[key]} in namespace "
                         f"{e.namespace}")
        seen[key] = e.name
    if hlen > HEADER_LIMIT:
        found.append(f"header of {hlen} bytes is over OCANNL's {HEADER_LIMIT}-byte limit")
    return found


def write(tree: Any, path: str) -> None:
    """Write `{namespace: subtree}` as a jckpt file that OCANNL reads.

    Warns when the header is over OCANNL's size limit (jckpt still reads such a file).

    Raises:
        InputError: before touching the file when a leaf's dtype is not an OCANNL prec.
    """
    path = os.fspath(path)
    items = host_items(check_namespaced(tree, path), path)
    for ns, p, array in items:
        prec = precs.prec_of(array.dtype)
        if prec not in precs.OCANNL_PRECS:
            widen = _WIDEN.get(prec)
            raise InputError(f"dtype {array.dtype} ({prec}) is not one OCANNL reads", file=path,
                             entry=f"{ns}/{path_name(p)}",
                             fix=f"cast it to {widen}" if widen else
                             "cast it to float32, bfloat16 or float16, or write a jckpt file")
    warn_key_data(tree, path, 'OCANNL')  # after every refusal: a refused tree is told that alone
    from jckpt.format.header import encode_header
    from jckpt.storage.writer import with_placeholders

    size = len(encode_header(with_placeholders(native.build_header(items)))) - 4
    if size > HEADER_LIMIT:
        warnings.warn(f"{path}: header of {size} bytes is over OCANNL's {HEADER_LIMIT}-byte limit; "
                      "OCANNL will refuse this file (jckpt reads it). Split the tree into "
                      "several files for OCANNL.", stacklevel=2)
    native.write_items(items, path)


def register() -> None:
    from jckpt.adapters import register_format

    register_format('ocannl', read=native.read, write=write, extensions=('.ocannl',),
                    replace=True)
