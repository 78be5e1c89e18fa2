"""Another format's file cut short (jckpt.adapters.cut_short): named so, not as unknown."""

import os

import numpy as np
import pytest

import jckpt
from jckpt.adapters.cut_short import cut_short_error
from jckpt.errors import FormatError


def _cut(tmp_path, ext, keep):
    whole = tmp_path / f'm.{ext}'
    jckpt.adapters.write({'jckpt': {'w': np.ones((32, 32), np.float32)}}, whole)
    cut = tmp_path / f'cut.{ext}'
    data = whole.read_bytes()
    cut.write_bytes(data[:keep(len(data))])
    return str(cut)


@pytest.mark.parametrize('ext,keep', [('npz', lambda n: n // 2), ('pt', lambda n: n - 30),
                                      ('safetensors', lambda n: 40)])
def test_a_file_cut_short_is_named_so(tmp_path, ext, keep):
    cut = _cut(tmp_path, ext, keep)
    with open(cut, 'rb') as f:
        error = cut_short_error(cut, f.read(64))
    assert error is not None and error.file == cut and 'cut short' in error.message
    with pytest.raises(FormatError, match='the file is cut short') as e:
        jckpt.detect_format(cut)  # was: "file is in no format jckpt recognises"
    assert 'copy or download it again' in e.value.fix


def test_whole_files_and_others_are_not_cut_short(tmp_path):
    for ext in ('npz', 'pt', 'safetensors'):
        path = _cut(tmp_path, ext, lambda n: n)
        with open(path, 'rb') as f:
            assert cut_short_error(path, f.read(64)) is None
    other = tmp_path / 'other.zip'  # a whole zip of no format jckpt reads
    import zipfile
    with zipfile.ZipFile(other, 'w') as zf:
        zf.writestr('readme.txt', 'hello')
    assert cut_short_error(str(other), other.read_bytes()[:64]) is None
    assert cut_short_error(str(tmp_path), None) is None
    assert cut_short_error(os.path.join(tmp_path, 'gone'), b'PK\x03\x04') is None


def test_the_sniffer_and_the_cut_short_check_read_one_length(tmp_path):
    """A safetensors file is recognised or called cut short by one reading of its first bytes
    (`safetensors.header_end`): one byte short of its header is cut short, and not sniffed."""
    from jckpt.adapters import safetensors
    whole = tmp_path / 'm.safetensors'
    jckpt.adapters.write({'jckpt': {'w': np.ones(4, np.float32)}}, whole)
    head = whole.read_bytes()[:64]
    end = safetensors.header_end(head)
    for size, recognised in ((end, True), (end - 1, False)):
        cut = tmp_path / f'cut{size}.safetensors'
        cut.write_bytes(whole.read_bytes()[:size])
        assert safetensors.sniff(str(cut), head) is recognised
        error = cut_short_error(str(cut), head)
        assert (error is None) is recognised
    assert error.message.startswith(f'the file is cut short: a safetensors file whose header says '
                                    f'{end} bytes of header, in a file of {end - 1}')
