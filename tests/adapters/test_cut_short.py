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
