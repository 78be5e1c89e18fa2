"""Step directories: staged, published whole by one rename, removed when abandoned."""

import os

import pytest

from jckpt.errors import StorageError
from jckpt.storage import step_directory as sd


def test_a_staged_directory_is_published_whole(tmp_path):
    staged, target = str(tmp_path / 'step.next.1'), str(tmp_path / 'step')
    sd.make_staged(staged)
    sd.write_text(os.path.join(staged, 'a.txt'), 'é\n')
    assert not sd.is_published(staged, 'marker.json')
    sd.write_text(os.path.join(staged, 'marker.json'), '{}')
    for durable in (True,):
        sd.publish_dir(staged, target, durable=durable)
    assert sorted(os.listdir(tmp_path)) == ['step']
    assert sd.is_published(target, 'marker.json') and sd.is_file(os.path.join(target, 'a.txt'))
    assert sd.read_text(os.path.join(target, 'a.txt')) == 'é\n'
    assert not sd.is_published(os.path.join(target, 'a.txt'), 'marker.json')


def test_make_staged_clears_an_earlier_attempt_and_remove_is_idempotent(tmp_path):
    staged = str(tmp_path / 'step.next.2')
    sd.make_staged(staged)
    sd.write_text(os.path.join(staged, 'old'), 'x')
    sd.make_staged(staged)
    assert os.listdir(staged) == []
    sd.remove_staged_dir(staged)
    sd.remove_staged_dir(staged)
    (tmp_path / 'file.next.3').write_bytes(b'')
    sd.remove_staged_dir(str(tmp_path / 'file.next.3'))
    assert os.listdir(tmp_path) == []


def test_failures_are_storage_errors_naming_the_path(tmp_path):
    with pytest.raises(StorageError) as e:
        sd.read_text(str(tmp_path / 'missing'))
    assert e.value.file == str(tmp_path / 'missing')
    with pytest.raises(StorageError):
        sd.write_text(str(tmp_path / 'no' / 'dir'), 'x')
    with pytest.raises(StorageError):
        sd.publish_dir(str(tmp_path / 'absent'), str(tmp_path / 'step'), durable=False)
