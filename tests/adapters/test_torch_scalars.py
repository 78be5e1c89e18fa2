"""Where a torch file's Python numbers and tuples are, and making them so again after a conversion."""

import json

import numpy as np

from jckpt.adapters._torch_scalars import MAX_SCALARS, scalar_record, with_scalars


def test_numbers_are_found_at_every_depth_and_restored_by_type():
    tree = {'g': [{'lr': 0.5, 'params': [0, 1], 'amsgrad': False, 'betas': (0.9, 0.99)}],
            'state': {0: {'step': np.array(3.0)}}, 'name': 'x', 'big': 2**70}
    record = scalar_record(tree)
    stored = {'g': [{'lr': np.array(0.5), 'params': [np.array(0), np.array(1)],
                     'amsgrad': np.array(False), 'betas': [np.array(0.9), np.array(0.99)]}],
              'state': {0: {'step': np.array(3.0)}}}
    back = with_scalars(stored, record)
    assert back['g'][0] == {'lr': 0.5, 'params': [0, 1], 'amsgrad': False, 'betas': (0.9, 0.99)}
    assert type(back['g'][0]['amsgrad']) is bool and type(back['g'][0]['params'][0]) is int
    assert type(back['g'][0]['betas']) is tuple  # a jckpt file reads it as a list
    assert isinstance(back['state'][0]['step'], np.ndarray)  # a tensor was a tensor
    assert isinstance(stored['g'][0]['lr'], np.ndarray)  # the input is not changed


def test_paths_that_are_gone_or_hold_arrays_are_left_alone():
    record = scalar_record({'a': 1, 'b': [2.0]})
    assert with_scalars({'a': np.ones(2)}, record)['a'].tolist() == [1.0, 1.0]
    assert with_scalars({'c': 1}, record) == {'c': 1}
    assert with_scalars({'a': 1}, 'not json') == {'a': 1}
    assert with_scalars({'a': 1}, json.dumps([[['k', 'a']], 'complex'], )) == {'a': 1}


def test_no_numbers_or_too_many_record_nothing():
    assert scalar_record({'w': np.ones(1), 's': 'x'}) is None
    assert scalar_record(list(range(MAX_SCALARS + 1))) is None


def test_nested_tuples_come_back_at_every_depth():
    """A tuple of tuples (and a tuple in a list) came back as lists of lists."""
    tree = {'t': ((1.0, np.ones(2)), [(2, 3)]), 'l': [4]}
    record = scalar_record(tree)
    stored = {'t': [[np.array(1.0), np.ones(2)], [[np.array(2), np.array(3)]]], 'l': [np.array(4)]}
    back = with_scalars(stored, record)
    assert type(back['t']) is tuple and type(back['t'][0]) is tuple and back['t'][0][0] == 1.0
    assert type(back['t'][1]) is list and back['t'][1][0] == (2, 3)
    assert back['l'] == [4] and type(back['l']) is list
    assert with_scalars({'t': np.ones(2)}, record)['t'].shape == (2,)  # not a list: left alone
