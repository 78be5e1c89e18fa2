"""Telling a jckpt header from another format's file by its first bytes."""

import struct

import pytest

from jckpt.errors import FormatError
from jckpt.format import Entry, Header, encode_header
from jckpt.format.sniff import foreign_error, foreign_kind, looks_like_header


def entry():
    return Entry(id=0, namespace="jckpt", prec="Single_prec", dims=(2,), offset=0, byte_length=8,
                 path=(("k", "w"),))


def test_looks_like_header_accepts_what_writers_write_and_nothing_shorter():
    raw = encode_header(Header(tensors=(entry(),)))
    assert looks_like_header(raw) and looks_like_header(raw[:13])
    ocannl = b"\n  " + raw[4:]  # OCANNL may put blanks before the S-expression
    assert looks_like_header(struct.pack(">I", len(ocannl)) + ocannl)
    assert not looks_like_header(raw[:12])                          # too short to tell
    assert not looks_like_header(struct.pack(">I", 8) + raw[4:])    # shorter than its own start
    assert not looks_like_header(b"PK\x03\x04\x14\x00\x00\x00\x08\x00\x00\x00!\x00")  # a zip
    assert not looks_like_header(raw[:4] + b"((tensors ()) (version 1))")
    assert not looks_like_header(b"")


@pytest.mark.parametrize('head, kind', [
    (b'PK\x03\x04\x14\x00', 'zip archive'), (b'\x80\x02\x8a\nl\xfc', 'legacy PyTorch'),
    (b'\x93NUMPY\x01\x00', 'numpy .npy'), (b'\x40\x00\x00\x00\x00\x00\x00\x00{"w"', 'safetensors'),
    (b'\x00\x00\x00\x20((version', None), (b'', None), (b'garbage garbage', None),
    (b'\x81\xa6params\x82', 'msgpack'), (b'\xde\x00\x14\xa2w0', 'msgpack'),
    (b'\xdf\x00\x00\x00\x14\xd9\x20', 'msgpack'), (b'\x81', None), (b'\x81\x00\x00\x20', None),
    (b'\x80\x04\x95\x1b\x01\x00', 'Python pickle'), (b'\x80\x05\x95', 'Python pickle'),
    (b'\x1f\x8b\x08\x00\x00\x00', 'gzip'), (b'\x1f\x8b\x08\x00((version', None),
])
def test_another_formats_file_is_told_from_its_first_bytes(head, kind):
    got = foreign_kind(head)
    assert got is None if kind is None else kind in got


def test_the_error_for_another_formats_file_says_what_it_is_and_how_to_read_it():
    e = foreign_error(b'\x80\x04\x95\x1b', 'header length 9 is too long', 'params.pkl')
    assert isinstance(e, FormatError) and e.file == 'params.pkl'
    assert e.message.startswith('it is a Python pickle') and 'never unpickles' in e.fix
    assert foreign_error(b'garbage garbage!', 'header length 9 is too long', 'x') is None
