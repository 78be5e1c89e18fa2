"""The llm.c GPT-2 adapter: header and parameter counts checked independently, tiny round trips."""

import struct

import ml_dtypes
import numpy as np
import pytest

import jckpt
from jckpt.adapters import llmc
from jckpt.errors import FormatError, InputError

GPT2_124M = llmc.Config(max_seq_len=1024, vocab_size=50257, num_layers=12, num_heads=12,
                        channels=768, padded_vocab_size=50304)
TINY = llmc.Config(max_seq_len=8, vocab_size=10, num_layers=2, num_heads=2, channels=4,
                   padded_vocab_size=16)


def count_by_hand(T, V, L, H, C, Vp):
    """GPT-2's parameters, counted from the architecture (independent of the adapter)."""
    embeddings = Vp * C + T * C
    per_layer = (2 * C                      # ln_1
                 + C * 3 * C + 3 * C        # attention qkv
                 + C * C + C                # attention projection
                 + 2 * C                    # ln_2
                 + C * 4 * C + 4 * C        # mlp fc
                 + 4 * C * C + C)           # mlp projection
    return embeddings + L * per_layer + 2 * C


def test_gpt2_124m_parameter_count():
    assert count_by_hand(1024, 50257, 12, 12, 768, 50304) == 124_475_904
    assert llmc.num_parameters(GPT2_124M) == 124_475_904


def test_header_bytes():
    raw = llmc.encode_header(GPT2_124M, np.float32)
    assert len(raw) == 1024
    ints = struct.unpack('<256i', raw)
    assert ints[:8] == (20240326, 3, 1024, 50257, 12, 12, 768, 50304) and not any(ints[8:])
    assert struct.unpack('<2i', llmc.encode_header(GPT2_124M, ml_dtypes.bfloat16)[:8]) == (20240326, 5)


def tiny_file(path, config=TINY, dtype=np.float32):
    """An llm.c file written by hand in the C layout, and the per-kind arrays in it."""
    T, V, L, H, C, Vp = (config.max_seq_len, config.vocab_size, config.num_layers,
                         config.num_heads, config.channels, config.padded_vocab_size)
    shapes = [('wte', (Vp, C)), ('wpe', (T, C)), ('ln1w', (L, C)), ('ln1b', (L, C)),
              ('qkvw', (L, 3 * C, C)), ('qkvb', (L, 3 * C)), ('attprojw', (L, C, C)),
              ('attprojb', (L, C)), ('ln2w', (L, C)), ('ln2b', (L, C)), ('fcw', (L, 4 * C, C)),
              ('fcb', (L, 4 * C)), ('fcprojw', (L, C, 4 * C)), ('fcprojb', (L, C)),
              ('lnfw', (C,)), ('lnfb', (C,))]
    arrays, start = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        arrays[name] = (np.arange(start, start + n) % 251 / 8 - 15).astype(dtype).reshape(shape)
        start += n
    assert start == count_by_hand(T, V, L, H, C, Vp)
    version = 3 if np.dtype(dtype) == np.float32 else 5
    header = struct.pack('<256i', 20240326, version, T, V, L, H, C, Vp, *[0] * 248)
    path.write_bytes(header + b''.join(a.tobytes() for a in arrays.values()))
    return arrays


@pytest.mark.parametrize('dtype', [np.float32, ml_dtypes.bfloat16])
def test_read_names_and_layout(tmp_path, dtype):
    path = tmp_path / 'gpt2_tiny.bin'
    arrays = tiny_file(path, dtype=dtype)
    assert jckpt.detect_format(path) == 'llmc'
    tree = jckpt.adapters.read(path)['jckpt']
    assert tree['wte'].dtype == np.dtype(dtype)
    assert np.array_equal(tree['wte'], arrays['wte']) and np.array_equal(tree['wpe'], arrays['wpe'])
    assert len(tree['h']) == 2
    for layer in range(2):
        h = tree['h'][layer]
        assert np.array_equal(h['attn']['c_attn']['weight'], arrays['qkvw'][layer])
        assert h['attn']['c_attn']['weight'].shape == (12, 4)
        assert np.array_equal(h['mlp']['c_proj']['weight'], arrays['fcprojw'][layer])
        assert h['mlp']['c_proj']['weight'].shape == (4, 16)
        assert np.array_equal(h['ln_2']['bias'], arrays['ln2b'][layer])
    assert np.array_equal(tree['ln_f']['weight'], arrays['lnfw'])
    assert {k: int(v) for k, v in tree['config'].items()} == {
        'max_seq_len': 8, 'vocab_size': 10, 'num_layers': 2, 'num_heads': 2, 'channels': 4,
        'padded_vocab_size': 16}
    assert not tree['h'][1]['attn']['c_attn']['weight'].flags.owndata  # mapped, not copied


@pytest.mark.parametrize('dtype', [np.float32, ml_dtypes.bfloat16])
def test_round_trip_bytes_exact_through_jckpt(tmp_path, dtype):
    src = tmp_path / 'a.bin'
    tiny_file(src, dtype=dtype)
    mid = tmp_path / 'a.jckpt'
    out = tmp_path / 'b.bin'
    assert jckpt.convert(src, mid) == ('llmc', 'jckpt')
    assert jckpt.convert(mid, out) == ('jckpt', 'llmc')
    assert out.read_bytes() == src.read_bytes()


def test_write_from_device_arrays_and_infers_dimensions(tmp_path):
    import jax.numpy as jnp
    src = tmp_path / 'a.bin'
    tiny_file(src)
    tree = jckpt.adapters.read(src)['jckpt']
    device = {'jckpt': {**{k: v for k, v in tree.items() if k != 'config'},
                        'config': {'num_heads': 2, 'vocab_size': 10}}}
    device['jckpt']['wte'] = jnp.asarray(tree['wte'])
    out = tmp_path / 'b.bin'
    llmc.write(device, out)
    assert out.read_bytes() == src.read_bytes()


def test_write_refuses_wrong_shapes_and_mixed_dtypes(tmp_path):
    src = tmp_path / 'a.bin'
    tiny_file(src)
    tree = jckpt.adapters.read(src)
    bad = {'jckpt': dict(tree['jckpt'], ln_f={'weight': np.zeros(5, np.float32),
                                              'bias': tree['jckpt']['ln_f']['bias']})}
    with pytest.raises(InputError, match='lnfw'):
        llmc.write(bad, tmp_path / 'x.bin')
    mixed = {'jckpt': dict(tree['jckpt'], wpe=tree['jckpt']['wpe'].astype(ml_dtypes.bfloat16))}
    with pytest.raises(InputError, match='wpe'):
        llmc.write(mixed, tmp_path / 'x.bin')
    with pytest.raises(InputError, match='config'):
        llmc.write({'jckpt': {k: v for k, v in tree['jckpt'].items() if k != 'config'}},
                   tmp_path / 'x.bin')
    assert not (tmp_path / 'x.bin').exists()


def test_big_endian_float32_is_float32(tmp_path):
    """'>f4' parameters were refused as "not float32 or bfloat16"."""
    src = tmp_path / 'a.bin'
    tiny_file(src)
    tree = jckpt.adapters.read(src)

    def swap(node):
        if isinstance(node, dict):
            return {k: swap(v) for k, v in node.items()}
        return node.astype('>f4') if isinstance(node, np.ndarray) else node

    llmc.write(swap(tree), tmp_path / 'be.bin')
    assert (tmp_path / 'be.bin').read_bytes() == src.read_bytes()


def test_check_refuses_what_write_refuses_reading_no_data(tmp_path):
    """`check` (the manager's save-time check) sees shapes and dtypes only: abstract leaves
    and typed keys pass through it, and it refuses the trees `write` refuses, naming the entry."""
    import jax
    src = tmp_path / 'a.bin'
    tiny_file(src)
    tree = jckpt.adapters.read(src)
    abstract = {'jckpt': {**jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                         {k: v for k, v in tree['jckpt'].items() if k != 'config'}),
                          'config': tree['jckpt']['config']}}
    llmc.check(abstract, 'm.bin')
    llmc.check(tree, 'm.bin')
    cases = [
        (dict(tree['jckpt'], ln_f={'weight': np.zeros(5, np.float32),
                                   'bias': tree['jckpt']['ln_f']['bias']}), 'lnfw', 'ln_f/weight'),
        (dict(tree['jckpt'], wpe=tree['jckpt']['wpe'].astype(ml_dtypes.bfloat16)), 'wpe', 'wpe'),
        ({k: jax.numpy.asarray(v).astype('float16') if k == 'wte' else v
          for k, v in tree['jckpt'].items()}, 'float16', 'wte'),
        (dict(tree['jckpt'], config=dict(tree['jckpt']['config'], channels=np.int32(8))),
         'config.channels is 8', 'config/channels'),
    ]
    for bad, match, entry in cases:
        with pytest.raises(InputError, match=match) as e:
            llmc.check({'jckpt': bad}, 'm.bin')
        assert e.value.file == 'm.bin' and e.value.entry == entry and e.value.fix
        with pytest.raises(InputError, match=match):
            llmc.write({'jckpt': bad}, tmp_path / 'x.bin')
    assert not (tmp_path / 'x.bin').exists()
    assert jckpt.adapters.get_format('llmc').check is llmc.check


def test_damaged_files_are_refused(tmp_path):
    path = tmp_path / 'a.bin'
    tiny_file(path)
    raw = path.read_bytes()
    cases = [(raw[:-4], 'truncated'), (raw + b'\0' * 4, 'trailing'), (raw[:100], 'shorter'),
             (struct.pack('<i', 20240328) + raw[4:], 'tokenizer'),
             (raw[:4] + struct.pack('<i', 4) + raw[8:], 'version 4'),
             (raw[:16] + struct.pack('<i', -1) + raw[20:], 'implausible'),
             (raw[:8] + struct.pack('<i', 10**9) + raw[12:], 'need')]
    for damaged, message in cases:
        path.write_bytes(damaged)
        with pytest.raises(FormatError, match=message) as info:
            llmc.read(path)
        assert str(path) in str(info.value)


@pytest.mark.parametrize('config, match', [
    ({'num_heads': np.int32(2), 'vocab_size': np.int32(17)}, 'vocab_size=17'),   # wte has 16 rows
    ({'num_heads': np.int32(0), 'vocab_size': np.int32(10)}, 'num_heads=0'),
    ({'num_heads': 2 ** 31, 'vocab_size': np.int32(10)}, 'num_heads=2147483648'),  # no int32
], ids=['vocab-over-padded', 'no-heads', 'heads-over-int32'])
def test_write_refuses_dimensions_the_reader_refuses(tmp_path, config, match):
    """The file was written, and reading it failed ("implausible dimensions"), or the
    header's packing failed with struct.error."""
    src = tmp_path / 'a.bin'
    tiny_file(src)
    tree = {'jckpt': dict(jckpt.adapters.read(src)['jckpt'], config=config)}
    with pytest.raises(InputError, match=match) as e:
        llmc.write(tree, tmp_path / 'x.bin')
    assert 'positive' in e.value.fix and not (tmp_path / 'x.bin').exists()
    with pytest.raises(InputError, match=match):
        llmc.check(tree, 'x.bin')
