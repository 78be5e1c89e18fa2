"""OCANNL interop both ways: files as OCANNL writes them load; what jckpt writes OCANNL accepts."""

import re
import struct
import warnings

import ml_dtypes
import numpy as np
import pytest

import jckpt
from jckpt.adapters import ocannl
from jckpt.errors import FormatError, InputError
from jckpt.format.sexp import parse
from tests.helpers import raw_file

#: OCANNL's precs and their element types, written out here independently of jckpt's table.
OCANNL = {
    'Byte_prec': np.uint8, 'Uint16_prec': np.uint16, 'Int32_prec': np.int32,
    'Uint32_prec': np.uint32, 'Int64_prec': np.int64, 'Uint64_prec': np.uint64,
    'Half_prec': np.float16, 'Bfloat16_prec': ml_dtypes.bfloat16, 'Fp8_prec': ml_dtypes.float8_e5m2,
    'Single_prec': np.float32, 'Double_prec': np.float64,
}
OCANNL_FIELDS = ['id', 'namespace', 'label', 'prec', 'dims', 'padding', 'offset', 'byte_length']


def ocannl_style_file(tmp_path):
    """Every OCANNL prec, a padded entry, the legacy "" namespace, no jckpt fields, alignment 16."""
    entries, data, expected = [], bytearray(), {}
    def add(ns, ident, prec, dims, values, padding='none'):
        offset = -(-len(data) // 16) * 16
        data.extend(b'\0' * (offset - len(data)))
        raw = values.tobytes()
        data.extend(raw)
        entries.append(f'((id {ident}) (namespace {ns}) (label (t {ident})) (prec {prec}) '
                       f'(dims ({" ".join(map(str, dims))})) (padding {padding}) (offset {offset}) '
                       f'(byte_length {len(raw)}))')
    rng = np.random.default_rng(1)
    for i, (prec, dtype) in enumerate(OCANNL.items()):
        values = np.frombuffer(rng.integers(0, 256, 6 * np.dtype(dtype).itemsize, dtype=np.uint8)
                               .tobytes(), dtype=dtype).reshape(2, 3)
        add('model' if i % 2 else '""', i, prec, (2, 3), values)
        expected[('model' if i % 2 else 'ocannl', f'n{i}')] = values
    key = np.arange(8, dtype='<u4')
    add('model', 20, 'Uint4x32_prec', (2,), key)
    expected[('model', 'n20')] = key.reshape(2, 4)
    region = np.arange(6, dtype='<f4').reshape(2, 3) + 1
    add('model', 21, 'Single_prec', (5, 4), region, padding='(((1 2) (0 1)) -1.5)')
    padded = np.full((5, 4), -1.5, np.float32)
    padded[1:3, 0:3] = region
    expected[('model', 'n21')] = padded
    text = f"((version 1) (alignment 16) (tensors ({' '.join(entries)})))"
    path = tmp_path / 'ocannl.ckpt'
    path.write_bytes(raw_file(text, bytes(data), align=16))
    return path, expected


def test_files_as_ocannl_writes_them_load(tmp_path):
    path, expected = ocannl_style_file(tmp_path)
    assert jckpt.detect_format(path) == 'jckpt'
    _, tree = jckpt.load(jckpt.Context(host=True), path)
    for (ns, name), values in expected.items():
        got = tree[ns][name]
        assert got.dtype == values.dtype and got.shape == values.shape, name
        assert got.tobytes() == values.tobytes(), name
    assert ocannl.problems(path) == []


def test_ocannl_file_converts_to_other_formats(tmp_path):
    path, expected = ocannl_style_file(tmp_path)
    out = tmp_path / 'o.npz'
    jckpt.convert(path, out)
    back = jckpt.adapters.read(out)
    assert back['model']['n21'].tobytes() == expected[('model', 'n21')].tobytes()
    assert back['ocannl']['n0'].tobytes() == expected[('ocannl', 'n0')].tobytes()


def test_void_prec_parses_and_refuses_loading(tmp_path):
    text = ('((version 1) (tensors (((id 0) (namespace "") (label (v)) (prec Void_prec) (dims (3)) '
            '(padding none) (offset 0) (byte_length 0)) ((id 1) (namespace "") (label (x)) '
            '(prec Single_prec) (dims (1)) (padding none) (offset 0) (byte_length 4)))))')
    path = tmp_path / 'void.ckpt'
    path.write_bytes(raw_file(text, np.float32(2).tobytes()))
    assert [e.prec for e in jckpt.describe(path).tensors] == ['Void_prec', 'Single_prec']
    with pytest.raises(FormatError, match='Void_prec'):
        jckpt.load(jckpt.Context(host=True), path)
    got = jckpt.restore(jckpt.Context(namespace='ocannl', host=True), {'n1': np.zeros(1, np.float32)},
                        path)
    assert got['n1'].tolist() == [2.0]


@pytest.mark.parametrize('padding,fault', [
    ('(((1 1) (0 0)) none)', "padding value 'none' is not a float"),
    ('(((1 1) (0 0)) 0x1p-1)', "padding value '0x1p-1' is not a float"),
    ('(((1 1)) 0.)', 'padding has 1 (L R) pairs for 2 dims'),
    ('(none)', 'padding must be none or'),
])
def test_padding_as_an_older_ocannl_wrote_it_is_refused_saying_so(tmp_path, padding, fault):
    """FORMAT.md refuses these forms; the error said only "not a float" or "1 pairs for 2 dims",
    not that the file comes from an older OCANNL writer nor how to get a readable one."""
    text = ('((version 1) (tensors (((id 0) (namespace "") (label (p)) (prec Single_prec) '
            f'(dims (3 2)) (padding {padding}) (offset 0) (byte_length 8)))))')
    path = tmp_path / 'old.ckpt'
    path.write_bytes(raw_file(text, np.ones(2, np.float32).tobytes()))
    for read in (jckpt.describe, lambda p: jckpt.load(jckpt.Context(host=True), p)):
        with pytest.raises(FormatError, match=re.escape(fault)) as e:
            read(path)
        assert 'looks like a file from an older OCANNL writer' in e.value.message
        assert 'save it again' in e.value.fix and e.value.file == str(path)
    assert 'older OCANNL writer' in str(jckpt.verify(path).errors[0])


def test_padding_damaged_otherwise_is_not_blamed_on_ocannl(tmp_path):
    text = ('((version 1) (tensors (((id 0) (namespace "") (label (p)) (prec Single_prec) '
            '(dims (2)) (padding (((0 0) (0 0)) 0.)) (offset 0) (byte_length 8)))))')
    path = tmp_path / 'odd.ckpt'
    path.write_bytes(raw_file(text, np.ones(2, np.float32).tobytes()))
    with pytest.raises(FormatError, match=r'2 \(L R\) pairs for 1 dims') as e:
        jckpt.describe(path)
    assert 'OCANNL' not in str(e.value)


def independent_check(path):
    """What OCANNL's reader requires, checked from the bytes with only an S-expression parser."""
    raw = path.read_bytes()
    (hlen,) = struct.unpack('>I', raw[:4])
    assert hlen <= 100_000_000
    fields = {f[0]: f[1] for f in parse(raw[4:4 + hlen].decode())}
    assert fields['version'] == '1'
    ids = set()
    for entry in fields['tensors']:
        keys = [f[0] for f in entry]
        assert keys[:8] == OCANNL_FIELDS
        e = dict((f[0], f[1]) for f in entry)
        assert e['prec'] in OCANNL or e['prec'] == 'Uint4x32_prec', e['prec']
        ident = (e['namespace'], e['id'])
        assert ident not in ids
        ids.add(ident)
        size = np.dtype(OCANNL.get(e['prec'], np.uint32)).itemsize
        assert (4 + hlen + int(e['offset'])) % size == 0  # OCANNL can map it
    return fields


def test_what_jckpt_writes_with_ocannl_precs_ocannl_accepts(tmp_path):
    tree = {'model': {name: np.ones((2, 2), dtype) for name, dtype in OCANNL.items()},
            'opt': {'m': [np.zeros(3, np.float32), np.zeros(3, np.float32)]}}
    path = tmp_path / 'w.ckpt'
    ocannl.write(tree, path)
    fields = independent_check(path)
    assert len(fields['tensors']) == len(OCANNL) + 2
    assert ocannl.problems(path) == []
    saved = tmp_path / 'saved.jckpt'
    jckpt.save(jckpt.Context(), {'w': np.ones(3, np.float32), 'k': jax_key()}, saved)
    independent_check(saved)
    assert ocannl.problems(saved) == []


def jax_key():
    import jax
    return jax.random.key(0)


def test_writer_refuses_what_ocannl_cannot_read(tmp_path):
    path = tmp_path / 'w.ckpt'
    for dtype, fix in [(np.bool_, 'uint8'), (np.int8, 'int32'), (ml_dtypes.float8_e4m3fn, 'float32'),
                       (np.complex64, 'float32')]:
        with pytest.raises(InputError, match=f'not one OCANNL reads.*{fix}'):
            ocannl.write({'m': {'x': np.zeros(2, dtype)}}, path)
    assert not path.exists()
    jckpt.save(jckpt.Context(), {'b': np.zeros(2, bool)}, path)
    assert ocannl.problems(path) == ['jckpt/b: prec Bool_prec is not an OCANNL prec']


def test_duplicate_ids_in_a_namespace_are_reported(tmp_path):
    entry = ('((id 4) (namespace m) (label (x)) (prec Single_prec) (dims (1)) (padding none) '
             '(offset {o}) (byte_length 4) (path ((k {k}))))')
    text = f"((version 1) (tensors ({entry.format(o=0, k='a')} {entry.format(o=4, k='b')})))"
    path = tmp_path / 'dup.ckpt'
    path.write_bytes(raw_file(text, bytes(8)))
    _, tree = jckpt.load(jckpt.Context(host=True), path)  # jckpt tells them apart by path
    assert set(tree['m']) == {'a', 'b'}
    assert ocannl.problems(path) == ['m/b: id 4 is also used by m/a in namespace m']


def test_header_over_the_limit_warns(tmp_path, monkeypatch):
    monkeypatch.setattr(ocannl, 'HEADER_LIMIT', 200)
    path = tmp_path / 'big.ckpt'
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        ocannl.write({'m': {f'x{i}': np.zeros(1, np.float32) for i in range(10)}}, path)
    assert any('over OCANNL' in str(w.message) for w in caught)
    assert path.exists() and any('limit' in p for p in ocannl.problems(path))
