"""The format registry: detection, conversion across formats, user formats."""

import json

import ml_dtypes
import numpy as np
import pytest

import jckpt
from jckpt import adapters
from jckpt.errors import FormatError, InputError


@pytest.fixture
def clean_registry():
    before = adapters.formats()
    yield
    with adapters._LOCK:
        adapters._FORMATS.clear()
        adapters._FORMATS.update(before)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def test_builtin_formats_are_registered():
    assert {'jckpt', 'safetensors', 'npz', 'npy', 'llmc', 'torch', 'orbax', 'ocannl'} <= set(
        adapters.formats())
    assert jckpt.convert is adapters.convert and jckpt.detect_format is adapters.detect_format


def test_conversion_chain_is_bit_exact(tmp_path):
    tree = {'params': {'w': np.arange(12, dtype=np.float32).reshape(3, 4) * 0.1,
                       'b': np.array([np.nan, -0.0, np.inf], np.float32),
                       'e': np.arange(4).astype(ml_dtypes.bfloat16)},
            'step': np.int32(9), 'layers': [np.ones(2, np.float16), np.zeros(1, np.uint8)]}
    jckpt.save(jckpt.Context(), tree, tmp_path / 'a.jckpt')
    chain = ['b.safetensors', 'c.npz', 'd.pt', 'e.jckpt']
    src = tmp_path / 'a.jckpt'
    formats = []
    for name in chain:
        formats.append(jckpt.convert(src, tmp_path / name))
        src = tmp_path / name
    assert formats == [('jckpt', 'safetensors'), ('safetensors', 'npz'), ('npz', 'torch'),
                       ('torch', 'jckpt')]
    back = jckpt.restore(jckpt.Context(host=True), tree, tmp_path / 'e.jckpt')
    for (p, a), (_, b) in zip(jckpt.trees.pytree.flatten(tree), jckpt.trees.pytree.flatten(back)):
        assert same_bits(a, b), p


def test_detect_refuses_unknown_and_missing(tmp_path):
    path = tmp_path / 'x.dat'
    path.write_bytes(b'hello world, not a checkpoint')
    with pytest.raises(FormatError, match='no format jckpt recognises') as info:
        jckpt.detect_format(path)
    assert str(path) in str(info.value)
    with pytest.raises(FormatError, match='no such file'):
        jckpt.detect_format(tmp_path / 'missing')
    with pytest.raises(FormatError, match='directory is in no format'):
        jckpt.detect_format(tmp_path)
    (tmp_path / 'tiny').write_bytes(b'')
    with pytest.raises(FormatError):
        jckpt.detect_format(tmp_path / 'tiny')


def test_destination_format(tmp_path):
    src = tmp_path / 'a.npz'
    adapters.write({'jckpt': {'w': np.ones(2)}}, src)
    assert jckpt.convert(src, tmp_path / 'out.data') == ('npz', 'jckpt')
    assert jckpt.detect_format(tmp_path / 'out.data') == 'jckpt'
    assert jckpt.convert(src, tmp_path / 'out.data2', format='safetensors') == ('npz', 'safetensors')
    with pytest.raises(InputError, match='destination format'):
        jckpt.convert(tmp_path / 'out.data', tmp_path / 'again.data')
    with pytest.raises(InputError, match='unknown format') as e:
        jckpt.convert(src, tmp_path / 'x', format='gguf')
    assert e.value.file == str(tmp_path / 'x')  # it named no file
    for call in (lambda: adapters.read(src, format='gguf'),
                 lambda: adapters.write({'jckpt': {'w': np.ones(2)}}, src, format='gguf')):
        with pytest.raises(InputError, match='unknown format') as e:
            call()
        assert e.value.file == str(src)
    with pytest.raises(InputError, match='same file'):
        jckpt.convert(src, src, format='npz')


@pytest.mark.parametrize('alias', ['pth', 'pt'])
def test_a_torch_files_extension_names_its_format_everywhere(tmp_path, alias):
    """`CheckpointOptions(format='pth')` took the torch format, where `convert(format='pth')`
    (and `jckpt convert --format pth`) was an unknown format: one name, two answers."""
    src = tmp_path / 'a.npz'
    adapters.write({'jckpt': {'w': np.ones(2, np.float32)}}, src)
    assert jckpt.convert(src, tmp_path / 'model.bin', format=alias) == ('npz', 'torch')
    assert jckpt.detect_format(tmp_path / 'model.bin') == 'torch'
    assert adapters.get_format(alias) is adapters.get_format('torch')
    assert jckpt.CheckpointOptions(format=alias).format == 'torch'


def test_a_format_registered_under_an_alias_is_that_format(tmp_path, clean_registry):
    jckpt.register_format('pt', read=adapters.get_format('npz').read)
    assert adapters.get_format('pt').name == 'pt' and adapters.format_name('pth') == 'torch'


def test_user_format(tmp_path, clean_registry):
    def write_json(tree, path):
        with open(path, 'w') as f:
            json.dump({k: np.asarray(v).tolist() for k, v in tree['jckpt'].items()}, f)

    def read_json(path):
        with open(path) as f:
            return {'jckpt': {k: np.asarray(v, np.float32) for k, v in json.load(f)[1].items()}}

    jckpt.register_format('jsonw', read=lambda p: {'jckpt': {k: np.asarray(v, np.float32) for k, v
                                                             in json.load(open(p)).items()}},
                          write=write_json, sniff=lambda p, head: head is not None and
                          head.startswith(b'{"'), extensions=('.jsonw',))
    with pytest.raises(InputError, match='already registered'):
        jckpt.register_format('jsonw', read=read_json)
    src = tmp_path / 'a.npz'
    adapters.write({'jckpt': {'w': np.arange(3, dtype=np.float32)}}, src)
    assert jckpt.convert(src, tmp_path / 'a.jsonw') == ('npz', 'jsonw')
    assert json.loads((tmp_path / 'a.jsonw').read_text()) == {'w': [0.0, 1.0, 2.0]}
    assert jckpt.convert(tmp_path / 'a.jsonw', tmp_path / 'b.jckpt') == ('jsonw', 'jckpt')
    _, tree = jckpt.load(jckpt.Context(host=True), tmp_path / 'b.jckpt')
    assert tree['jckpt']['w'].tolist() == [0.0, 1.0, 2.0]
    # a format registered later is tried first
    jckpt.register_format('npz_claim', read=adapters.get_format('npz').read,
                          sniff=lambda p, head: str(p).endswith('.npz'))
    assert jckpt.detect_format(src) == 'npz_claim'
    with pytest.raises(InputError, match='cannot be written'):
        adapters.write({'jckpt': {}}, tmp_path / 'x', format='npz_claim')


def test_adapters_refuse_unnamespaced_trees(tmp_path):
    with pytest.raises(InputError, match='namespace'):
        adapters.write({'not valid!': np.ones(1)}, tmp_path / 'a.npz')
    with pytest.raises(InputError, match='namespace'):
        adapters.write([np.ones(1)], tmp_path / 'a.safetensors')


@pytest.mark.parametrize('name,fmt', [('a.safetensors', 'safetensors'), ('a.npz', 'npz'),
                                      ('a.npy', 'npy'), ('a.pt', 'torch'), ('a.jckpt', 'jckpt'),
                                      ('a.bin', 'llmc')])
@pytest.mark.parametrize('damage', ['truncated', 'corrupt'])
def test_damaged_file_in_each_format_is_refused(tmp_path, name, fmt, damage):
    path = tmp_path / name
    if fmt == 'llmc':
        from jckpt.adapters import llmc
        config = llmc.Config(4, 5, 1, 1, 2, 8)
        path.write_bytes(llmc.encode_header(config, np.float32) +
                         np.zeros(llmc.num_parameters(config), np.float32).tobytes())
    else:
        tree = {'jckpt': {'w': np.arange(64, dtype=np.float32)}} if fmt != 'npy' else \
            {'jckpt': np.arange(64, dtype=np.float32)}
        adapters.write(tree, path)
    raw = path.read_bytes()
    if damage == 'truncated':
        raw = raw[:len(raw) // 2]
    else:  # the first bytes that describe the content, overwritten
        raw = raw[:2] + b'\xff' * 14 + raw[16:]
    path.write_bytes(raw)
    with pytest.raises(FormatError) as info:
        adapters.read(path, format=fmt)
    assert str(path) in str(info.value)
    with pytest.raises(FormatError):
        jckpt.convert(path, tmp_path / 'out.safetensors')
    assert not (tmp_path / 'out.safetensors').exists()


@pytest.mark.parametrize('fmt', ['safetensors', 'npz', 'npy', 'torch', 'llmc'])
def test_random_damage_gives_only_checkpoint_errors(tmp_path, fmt):
    """Seeded byte flips and truncations anywhere: a read succeeds or raises CheckpointError."""
    import random
    import warnings
    path = tmp_path / 'a'
    if fmt == 'llmc':
        from jckpt.adapters import llmc
        config = llmc.Config(4, 5, 1, 1, 2, 8)
        path.write_bytes(llmc.encode_header(config, np.float32) +
                         np.zeros(llmc.num_parameters(config), np.float32).tobytes())
    else:
        tree = {'w': np.arange(24, dtype=np.float32).reshape(4, 6), 'b': [np.arange(5, dtype=np.int16)]}
        adapters.write({'jckpt': tree if fmt != 'npy' else tree['w']}, path, format=fmt)
    raw = path.read_bytes()
    rng = random.Random(fmt)
    damaged = tmp_path / 'd'
    for _ in range(150):
        data = bytearray(raw)
        if rng.random() < 0.3:
            data = data[:rng.randrange(len(data))]
        else:
            for _ in range(rng.randint(1, 4)):
                near = rng.randrange(min(len(data), 512))
                data[rng.choice([near, len(data) - 1 - near, rng.randrange(len(data))])] = \
                    rng.randrange(256)
        damaged.write_bytes(bytes(data))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter('ignore')
                adapters.read(damaged, format=fmt)
        except jckpt.CheckpointError:
            pass


def test_directory_checkpoint_converts(tmp_path):
    from jckpt.api.multiprocess import save_directory
    tree = {'w': np.arange(6.0).reshape(2, 3), 'b': np.ones(2, np.float32)}
    save_directory(jckpt.Context(), tree, tmp_path / 'dir')
    assert jckpt.detect_format(tmp_path / 'dir') == 'jckpt'
    assert jckpt.convert(tmp_path / 'dir', tmp_path / 'd.safetensors') == ('jckpt', 'safetensors')
    back = adapters.read(tmp_path / 'd.safetensors')['jckpt']
    assert same_bits(back['w'], tree['w']) and same_bits(back['b'], tree['b'])


def test_register_format_refuses_hooks_that_are_not_functions():
    read = lambda path: {}
    for kwargs in ({"read": None}, {"read": read, "write": "w"}, {"read": read, "sniff": 1},
                   {"read": read, "extensions": 5}, {"read": read, "extensions": ".mine"},
                   {"read": read, "extensions": (1,)}):
        with pytest.raises(InputError):
            jckpt.register_format("refused_format", **kwargs)
    assert "refused_format" not in adapters.formats()


def test_a_manager_or_one_of_its_steps_is_not_converted_as_one_file(tmp_path):
    """A safetensors step holds model.safetensors: it converted as that file alone, dropping the
    optimizer and trainer state without a word."""
    import jckpt
    opts = jckpt.CheckpointOptions(format='safetensors')
    with jckpt.CheckpointManager(tmp_path / 'run', options=opts) as mgr:
        mgr.save(1, items={'model': {'w': np.ones(2)}, 'opt': {'m': np.ones(2)}})
    step = tmp_path / 'run' / 'step_00000001.jckpt'
    for src, match in ((step, 'one step of a checkpoint manager'),
                       (tmp_path / 'run', "a checkpoint manager's directory")):
        with pytest.raises(jckpt.FormatError, match=match):
            jckpt.convert(src, tmp_path / 'out.jckpt')
    assert not (tmp_path / 'out.jckpt').exists()
    assert jckpt.convert(step / 'model.safetensors', tmp_path / 'model.jckpt')  # the file alone


def test_a_hugging_face_trainer_checkpoint_still_converts(tmp_path):
    """Its `checkpoint-500/` holds `model.safetensors` and a `trainer_state.json` of its own:
    not a step of a jckpt manager."""
    import jckpt
    from jckpt.tools.classify import classify
    hf = tmp_path / 'checkpoint-500'
    hf.mkdir()
    jckpt.adapters.write({'jckpt': {'w': np.arange(3.0)}}, hf / 'model.safetensors')
    (hf / 'trainer_state.json').write_text('{"global_step": 500, "log_history": []}')
    assert jckpt.detect_format(hf) == 'safetensors'
    assert jckpt.convert(hf, tmp_path / 'hf.jckpt') == ('safetensors', 'jckpt')
    assert (classify(str(hf)).name, classify(str(hf)).detail) == ('foreign', 'safetensors')


def test_a_format_may_check_a_tree_from_shapes_and_dtypes(tmp_path, clean_registry):
    """What a manager asks before admitting a step: no data is read, typed keys are their
    key data, and a check that is not a function is refused."""
    import jax
    import jax.numpy as jnp

    import jckpt
    from jckpt.adapters import _common, get_format
    seen = []
    fmt = jckpt.register_format('checked', read=lambda p: {}, write=lambda t, p: None,
                                check=lambda tree, path: seen.append(
                                    _common.abstract_items(tree, path)), replace=True)
    fmt.check({'m': {'k': jax.random.key(0), 'w': jax.ShapeDtypeStruct((2, 3), jnp.bfloat16),
                     'n': 3}}, 'x.checked')
    specs = {p[0][1]: (s.shape, str(s.dtype)) for _, p, s in seen[0]}
    assert specs == {'k': ((2,), 'uint32'), 'w': ((2, 3), 'bfloat16'), 'n': ((), 'int64')}
    get_format('safetensors').check({'m': {'w': jax.ShapeDtypeStruct((2,), jnp.bfloat16)}}, 'x')
    with pytest.raises(jckpt.InputError, match="check must be a function"):
        jckpt.register_format('bad', read=lambda p: {}, check=3)


def test_convert_one_namespace_keeps_its_names(tmp_path):
    """Adding an `ema` namespace renamed every tensor of a safetensors export
    (`w` became `params.w`); converting only `params` keeps the names, as for one namespace."""
    from safetensors.numpy import load_file
    src = tmp_path / 'train.jckpt'
    jckpt.save(jckpt.Context(namespace='params'), {'w': np.ones(2, np.float32)}, src)
    jckpt.save(jckpt.Context(namespace='ema'), {'w': np.zeros(2, np.float32)}, src, appending=True)
    assert jckpt.convert(src, tmp_path / 'p.safetensors', namespaces='params') == ('jckpt', 'safetensors')
    assert list(load_file(tmp_path / 'p.safetensors')) == ['w']
    jckpt.convert(src, tmp_path / 'both.safetensors', namespaces=['params', 'ema'])
    assert sorted(load_file(tmp_path / 'both.safetensors')) == ['ema.w', 'params.w']
    with pytest.raises(jckpt.MissingEntryError, match="no namespace 'opt'") as e:
        jckpt.convert(src, tmp_path / 'x.npz', namespaces=['opt'])
    assert "['ema', 'params']" in e.value.fix and not (tmp_path / 'x.npz').exists()
    with pytest.raises(jckpt.InputError, match="namespaces must be"):
        jckpt.convert(src, tmp_path / 'x.npz', namespaces=[3])


def test_a_format_that_keeps_metadata_gets_what_the_source_holds_besides_arrays(
        tmp_path, clean_registry):
    seen = {}

    def write_meta(tree, path, metadata=None):
        seen['metadata'] = metadata
        adapters.write(tree, path, format='npz')

    src = tmp_path / 'm.jckpt'
    jckpt.save(jckpt.Context(), {'w': np.ones(2, np.float32)}, src, metadata={'run': '7'})
    jckpt.register_format('meta', read=adapters.get_format('npz').read, write=write_meta,
                          keeps_metadata=True)
    jckpt.convert(src, tmp_path / 'a', format='meta')
    assert seen['metadata'] == {'run': '7'}
    jckpt.register_format('plain', read=adapters.get_format('npz').read,
                          write=lambda tree, path: adapters.write(tree, path, format='npz'))
    with pytest.warns(UserWarning, match=r"\['run'\] .* is not kept in 'plain'"):
        jckpt.convert(src, tmp_path / 'b', format='plain')


@pytest.mark.parametrize('ext', ['.pt', '.safetensors', '.npz'])
def test_convert_nests_a_state_dict_when_asked(tmp_path, ext):
    """A torch (or Hugging Face) state_dict into the nested tree a JAX model holds."""
    src = tmp_path / f'sd{ext}'
    flat = {'dense.kernel': np.ones((2, 3), np.float32), 'dense.bias': np.zeros(3, np.float32),
            'layers.0.w': np.ones(1, np.float32)}
    if ext == '.pt':
        adapters.get_format('torch').write({'jckpt': flat}, src, flat=False)  # as torch saves it
    else:
        from safetensors.numpy import save_file
        save_file(flat, src) if ext == '.safetensors' else np.savez(src, **flat)
    out = tmp_path / 'nested.jckpt'
    jckpt.convert(src, out, nest=True)
    _, tree = jckpt.load(jckpt.Context(host=True), out)
    assert tree['jckpt']['dense']['kernel'].shape == (2, 3)
    assert tree['jckpt']['layers']['0']['w'].tolist() == [1.0]
    jckpt.convert(src, tmp_path / 'flat.jckpt')
    _, tree = jckpt.load(jckpt.Context(host=True), tmp_path / 'flat.jckpt')
    assert sorted(tree['jckpt']) == ['dense.bias', 'dense.kernel', 'layers.0.w']


def test_a_format_read_once_for_tree_and_metadata(tmp_path, clean_registry):
    """convert and inspect read the tree and the metadata with one call where the format
    gives one (`read_with_metadata`), and with `read` and `read_metadata` otherwise."""
    calls = []

    def both(path):
        calls.append('both')
        return {'jckpt': {'w': np.arange(2.0)}}, {'run': 'a'}

    jckpt.register_format('once', read=lambda p: calls.append('read'),
                          read_metadata=lambda p: calls.append('meta'), read_with_metadata=both,
                          sniff=lambda p, head: str(p).endswith('.once'))
    (tmp_path / 'a.once').write_bytes(b'x')
    assert jckpt.convert(tmp_path / 'a.once', tmp_path / 'a.jckpt') == ('once', 'jckpt')
    assert jckpt.describe(tmp_path / 'a.jckpt').metadata_dict()['run'] == 'a'
    assert dict(jckpt.info(tmp_path / 'a.once').metadata) == {'run': 'a'}
    assert calls == ['both', 'both']
    assert adapters.read_with_metadata(tmp_path / 'a.once')[1] == {'run': 'a'}
    with pytest.raises(InputError, match='read_with_metadata must be a function'):
        jckpt.register_format('bad', read=both, read_with_metadata='no')
    jckpt.register_format('twice', read=lambda p: {'jckpt': {'w': np.ones(1)}},
                          read_metadata=lambda p: {'run': 'b'})
    assert adapters.read_with_metadata(tmp_path / 'a.once', 'twice')[1] == {'run': 'b'}


def test_convert_never_replaces_a_file_that_is_not_a_checkpoint(tmp_path):
    # it wrote over it: convert replaces its destination, which must be a checkpoint
    np.savez(tmp_path / 'w.npz', w=np.zeros(3))
    notes = tmp_path / 'notes.txt'
    notes.write_text('hi')
    with pytest.raises(InputError, match=r'converting would replace a file that is not a '
                                         r'checkpoint \(2 bytes\)') as e:
        jckpt.convert(tmp_path / 'w.npz', notes, format='jckpt')
    assert e.value.file == str(notes) and 'another path' in e.value.fix
    assert notes.read_text() == 'hi'
    (tmp_path / 'd').mkdir()
    (tmp_path / 'd' / 'a.txt').write_text('a')
    (tmp_path / 'd' / 'b.txt').write_text('b')
    with pytest.raises(InputError, match=r'a directory holding 2 entries that are no part of a '
                                         r'checkpoint \(a.txt, b.txt\)'):
        jckpt.convert(tmp_path / 'w.npz', tmp_path / 'd', format='jckpt')
    jckpt.convert(tmp_path / 'w.npz', tmp_path / 'w.jckpt')
    assert jckpt.convert(tmp_path / 'w.npz', tmp_path / 'w.jckpt') == ('npz', 'jckpt')  # replaced
