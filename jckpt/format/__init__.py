"""The codec: pure functions between headers, payloads and bytes (numpy only, no JAX).

Everything here follows the file format's specification (`docs/format.md`).
"""

from jckpt.format.header import (
    DEFAULT_ALIGNMENT,
    FORMAT_VERSION,
    Entry,
    Header,
    Padding,
    decode_header,
    encode_header,
    header_text,
    path_name,
    round_up,
    split_header,
)
from jckpt.format.layout import check_extents, data_size, lay_out, plan_layout
from jckpt.format.payload import (
    can_map,
    checksum,
    decode_payload,
    encode_payload,
    iter_payload_chunks,
)
from jckpt.format.precs import dtype_of, element_size, prec_of

__all__ = [
    'DEFAULT_ALIGNMENT', 'FORMAT_VERSION', 'Entry', 'Header', 'Padding', 'can_map',
    'check_extents', 'checksum', 'data_size', 'decode_header', 'decode_payload', 'dtype_of',
    'element_size', 'encode_header', 'encode_payload', 'header_text', 'iter_payload_chunks',
    'lay_out', 'path_name', 'plan_layout', 'prec_of', 'round_up', 'split_header',
]
