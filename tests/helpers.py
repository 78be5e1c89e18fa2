"""Test helpers: write raw checkpoint files by hand, independently of the writer."""

import struct


def raw_file(text: str | bytes, data: bytes = b"", *, align: int = 1,
             hlen: int | None = None) -> bytes:
    """A file from header text and data bytes, padding the header to ``align``."""
    body = text.encode("utf-8") if isinstance(text, str) else text
    size = 4 + len(body)
    if align > 1:
        size = -(-size // align) * align
    body = body + b" " * (size - 4 - len(body))
    return struct.pack(">I", len(body) if hlen is None else hlen) + body + data


def entry_text(*, id=0, ns="jckpt", prec="Single_prec", dims="(1)", offset=0, length=4,
               padding="none", extra="") -> str:
    return (f"((id {id}) (namespace {ns}) (label (x)) (prec {prec}) (dims {dims}) "
            f"(padding {padding}) (offset {offset}) (byte_length {length}){extra})")


def header_text(*entries: str, version=1, alignment="(alignment 1)") -> str:
    return f"((version {version}) {alignment} (tensors ({' '.join(entries)})))"
