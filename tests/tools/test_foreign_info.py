"""``jckpt.tools.foreign_info``: another tool's checkpoint listed as the converter reads it
(``jckpt.info`` and ``jckpt inspect`` on a safetensors, ``.pt``, numpy, llm.c or orbax one)."""

import json

import ml_dtypes
import numpy as np
import pytest

import jckpt
from jckpt.adapters import write as write_format
from jckpt.adapters.safetensors import write_sharded
from jckpt.tools.foreign_info import ForeignInfo, foreign_info
from tests.tools.test_cli import jckpt_cmd


def _state():
    return {'jckpt': {'layers': [{'w': np.ones((4, 3), np.float32)},
                                 {'w': np.zeros((4, 3), ml_dtypes.bfloat16)}],
                      'step': np.int32(7)}}


def _names(summary):
    return {(e.path, e.dtype, e.shape, e.nbytes) for e in summary.entries}


EXPECTED = {('layers/0/w', 'float32', (4, 3), 48), ('layers/1/w', 'bfloat16', (4, 3), 24),
            ('step', 'int32', (), 4)}


@pytest.mark.parametrize('ext', ['safetensors', 'pt', 'npz'])
def test_each_format_lists_its_arrays_as_the_converter_reads_them(tmp_path, ext):
    path = tmp_path / f'model.{ext}'
    write_format(_state(), path)
    summary = jckpt.info(path)
    assert isinstance(summary, ForeignInfo) and summary.format == jckpt.detect_format(path)
    if ext == 'npz':  # flat names: the structure lives only in jckpt's own formats
        assert {e.dtype for e in summary.entries} == {'float32', 'bfloat16', 'int32'}
    else:
        assert _names(summary) == EXPECTED
    assert summary.payload_bytes == 76 and summary.size == path.stat().st_size
    assert f'{summary.format} checkpoint, 3 arrays in 1 namespace' in repr(summary)


def test_safetensors_metadata_and_the_json_form(tmp_path):
    from jckpt.adapters.safetensors import write as write_safetensors
    path = tmp_path / 'hf.safetensors'
    write_safetensors({'jckpt': {'w': np.ones(2, np.float16)}}, path, metadata={'source': 'hub'})
    summary = jckpt.info(path)
    assert dict(summary.metadata) == {'format': 'pt', 'source': 'hub'}
    assert 'source: hub' in summary.render()
    data = summary.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data['kind'] == 'foreign' and data['format'] == 'safetensors'
    assert data['entries'] == [{'namespace': 'jckpt', 'path': 'w', 'dtype': 'float16',
                                'shape': [2], 'nbytes': 4}]
    assert '<table>' in summary._repr_html_() and 'hub' in summary._repr_html_()


def test_an_orbax_directory_is_described_from_its_metadata(tmp_path):
    ocp = pytest.importorskip('orbax.checkpoint')
    import jax.numpy as jnp
    path = tmp_path / 'step'
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, {'a': jnp.ones((2, 3)), 'b': {'c': jnp.zeros(4, jnp.bfloat16)}})
    summary = foreign_info(path, 'orbax')
    assert _names(summary) == {('a', 'float32', (2, 3), 24), ('b/c', 'bfloat16', (4,), 8)}
    assert summary.size > summary.payload_bytes


def test_a_damaged_file_gets_the_converters_error(tmp_path):
    path = tmp_path / 'model.safetensors'
    write_format(_state(), path)
    raw = bytearray(path.read_bytes())
    path.write_bytes(bytes(raw[:40]))  # the header cut short
    with pytest.raises(jckpt.FormatError) as e:
        jckpt.info(path)
    assert e.value.file == str(path)


def test_many_arrays_are_cut_in_repr_but_not_in_render(tmp_path):
    path = tmp_path / 'many.npz'
    np.savez(path, **{f'a{i:03d}': np.zeros(1) for i in range(60)})
    summary = jckpt.info(path)
    assert 'more arrays' in repr(summary) and 'more arrays' not in summary.render()
    assert len(summary.entries) == 60 and summary.namespaces == {'jckpt': 60}


def test_the_command_line_inspects_another_format(tmp_path):
    path = tmp_path / 'model.pt'
    write_format(_state(), path)
    p = jckpt_cmd('inspect', path)
    assert p.returncode == 0, p.stderr
    assert 'torch checkpoint, 3 arrays' in p.stdout and 'layers/1/w' in p.stdout
    data = json.loads(jckpt_cmd('inspect', path, '--json').stdout)
    assert data['totals'] == {'entries': 3, 'payload_bytes': 76, 'namespaces': {'jckpt': 3}}


def test_a_sharded_index_counts_its_shards_on_disk(tmp_path):
    """`jckpt inspect model.safetensors.index.json` said "272 B on disk": the index alone."""
    index = tmp_path / 'model.safetensors.index.json'
    write_sharded({'jckpt': {'a': np.ones(1000, np.float32), 'b': np.ones(1000, np.float32)}},
                  index, max_shard_bytes=4000)
    files = [index, *sorted(tmp_path.glob('model-*.safetensors'))]
    assert len(files) == 3
    assert jckpt.info(index).size == sum(f.stat().st_size for f in files)
