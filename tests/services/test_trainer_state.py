"""TrainerState (jckpt.services.trainer_state): the JSON round trip, its refusals, the layout check."""

import dataclasses
import json
import math

import numpy as np
import pytest

import jckpt
from jckpt.errors import FormatError, InputError, MismatchError
from jckpt.services.trainer_state import TRAINER_STATE_KEY, TrainerState


def test_trainer_state_json_round_trip_and_validation():
    s = jckpt.TrainerState(global_step=3, best_loss=float("inf"), tp=2, user={"a": [1, 2]})
    assert jckpt.TrainerState.from_json(s.to_json()) == s
    with pytest.raises(jckpt.InputError, match="dp"):
        jckpt.TrainerState(dp=0)
    with pytest.raises(jckpt.InputError, match="JSON"):
        jckpt.TrainerState(user={"f": object()}).to_json()
    with pytest.raises(jckpt.FormatError, match="not valid JSON"):
        jckpt.TrainerState.from_json("{")


def test_the_public_name_and_the_metadata_key():
    assert jckpt.TrainerState is TrainerState
    assert TRAINER_STATE_KEY == 'jckpt.trainer_state'


def test_defaults_layout_and_replace():
    s = TrainerState()
    assert (s.global_step, s.consumed_batches, s.learning_rate, s.best_loss) == (0, 0, None, None)
    assert s.layout == (1, 1, 1) and s.user == {}
    t = s.replace(global_step=5, tp=4)
    assert (t.global_step, t.layout) == (5, (1, 4, 1))
    assert s.global_step == 0  # replace makes a copy
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.global_step = 1  # type: ignore[misc]


def test_to_json_is_a_sorted_object_with_every_field():
    s = TrainerState(global_step=7, learning_rate=1e-3, pp=2, user={'seed': 0, 'tags': ['a']})
    text = s.to_json()
    fields = json.loads(text)
    assert list(fields) == sorted(fields)
    assert fields == {'global_step': 7, 'consumed_batches': 0, 'learning_rate': 1e-3,
                      'best_loss': None, 'dp': 1, 'tp': 1, 'pp': 2,
                      'user': {'seed': 0, 'tags': ['a']}}


def strict_json(text):
    """`json.loads` as a strict parser has it: `NaN`, `Infinity` and `-Infinity` refused."""
    def refuse(token):
        raise ValueError(f"{token} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_floats_survive_the_round_trip_as_strict_json():
    """A loss gone NaN was written as the bare token `NaN`, which strict JSON parsers (jq,
    JavaScript's JSON.parse, serde_json) refuse."""
    s = TrainerState(best_loss=float('nan'), learning_rate=float('-inf'),
                     user={'loss': float('nan'), 'history': [1.5, float('inf')],
                           'f32': np.float32('nan'), 'nested': {'g': -np.float64('inf')}})
    fields = strict_json(s.to_json())
    assert fields['best_loss'] == {'$float': 'nan'} and fields['user']['f32'] == {'$float': 'nan'}
    back = TrainerState.from_json(s.to_json())
    assert math.isnan(back.best_loss) and back.learning_rate == float('-inf')
    assert math.isnan(back.user['loss']) and math.isnan(back.user['f32'])
    assert back.user['history'] == [1.5, float('inf')] and back.user['nested'] == {'g': -math.inf}


@pytest.mark.parametrize('value', [{'$float': 'nan'}, {'$object': [['a', 1]]}, {'$float': 2},
                                   {'$float': 'nan', 'other': 1}, {'a': {'$object': []}}])
def test_user_dicts_that_look_like_the_encoding_come_back_as_themselves(value):
    s = TrainerState(user={'v': value, 'in_list': [value]})
    strict_json(s.to_json())
    assert TrainerState.from_json(s.to_json()) == s


@pytest.mark.parametrize('value', [[[1], 2], [{'a': 1}, 2]])
def test_a_crafted_object_tag_with_a_key_no_dict_holds_reads_as_itself(value):
    """`{"$object": [[[1], 2]]}` raised TypeError (unhashable list) out of from_json."""
    text = json.dumps({'user': {'x': {'$object': [value]}}})
    assert TrainerState.from_json(text).user == {'x': {'$object': [value]}}


def test_the_bare_nan_and_infinity_earlier_versions_wrote_still_read():
    back = TrainerState.from_json('{"best_loss": NaN, "user": {"loss": -Infinity}}')
    assert math.isnan(back.best_loss) and back.user == {'loss': -math.inf}


def test_unknown_fields_are_kept_under_user():
    text = json.dumps({'global_step': 2, 'epoch': 4, 'user': {'seed': 1}})
    back = TrainerState.from_json(text)
    assert back.global_step == 2
    assert back.user == {'seed': 1, '_unknown': {'epoch': 4}}
    assert TrainerState.from_json('{}') == TrainerState()


@pytest.mark.parametrize('field,value', [('global_step', -1), ('consumed_batches', 1.0),
                                         ('global_step', True), ('dp', 0), ('tp', '2'),
                                         ('pp', None)])
def test_counts_and_layout_must_be_integers(field, value):
    with pytest.raises(InputError, match=f"TrainerState.{field} must be"):
        TrainerState(**{field: value})


def test_numpy_and_jax_scalars_are_taken_as_python_numbers():
    """What a training loop has at hand: `state.step` (a JAX int), a schedule's output (a
    JAX float), numpy counters; a schedule's value was refused as "TrainerState.user is not
    JSON-serializable", naming the wrong field."""
    import jax.numpy as jnp
    import numpy as np
    s = TrainerState(global_step=jnp.int32(2), consumed_batches=np.int64(5),
                     learning_rate=jnp.float32(0.5), best_loss=np.float64(0.25), dp=np.int8(2),
                     user={'seed': np.int64(3), 'lr': [jnp.float32(1.5)]})
    assert (type(s.global_step), type(s.consumed_batches), type(s.dp)) == (int, int, int)
    assert (s.global_step, s.learning_rate, s.best_loss) == (2, 0.5, 0.25)
    assert type(s.learning_rate) is float
    assert json.loads(s.to_json())['user'] == {'seed': 3, 'lr': [1.5]}
    assert TrainerState.from_json(s.to_json()) == s


@pytest.mark.parametrize('field,value', [('learning_rate', '0.1'), ('best_loss', True),
                                         ('learning_rate', [0.1]), ('best_loss', object())])
def test_rates_and_losses_must_be_numbers(field, value):
    with pytest.raises(InputError, match=f"TrainerState.{field} must be a real number") as e:
        TrainerState(**{field: value})
    assert e.value.fix == f"pass float({field})"


def test_user_must_be_a_mapping():
    with pytest.raises(InputError, match='TrainerState.user must be a mapping, not list'):
        TrainerState(user=[1, 2])  # type: ignore[arg-type]



@pytest.mark.parametrize('user,where,key', [
    ({1: 2}, 'TrainerState.user', '1'),
    ({'seeds': {0: 7}}, "TrainerState.user['seeds']", '0'),
    ({'runs': [{'a': 1}, {(1, 2): 3}]}, "TrainerState.user['runs'][1]", '(1, 2)'),
    ({'x': 1, 2.5: 'y'}, 'TrainerState.user', '2.5'),
])
def test_a_user_key_that_is_not_a_string_is_refused_where_it_sits(user, where, key):
    # JSON makes every key a string: {1: 2} came back as {'1': 2}, and a lookup by 1 after a
    # resume failed far from the save; a mix of keys failed in json.dumps's sort instead
    with pytest.raises(InputError) as e:
        TrainerState(user=user)
    assert e.value.message.startswith(f"{where} has the key {key}, not a string")
    assert "str(key)" in e.value.fix


@pytest.mark.parametrize('user,where,kind', [
    ({'seen': {1, 2}}, "TrainerState.user['seen']", 'set'),
    ({'runs': [{'a': np.arange(3)}]}, "TrainerState.user['runs'][0]['a']", 'ndarray'),
    ({'blob': b'x'}, "TrainerState.user['blob']", 'bytes'),
])
def test_a_user_value_json_cannot_hold_is_refused_where_it_sits(user, where, kind):
    # it was taken, and refused by the manager's save alone, naming neither the key nor the step
    with pytest.raises(InputError) as e:
        TrainerState(user=user)
    assert e.value.message.startswith(f"{where} is a {kind} (")
    assert "JSON cannot hold" in e.value.message and "lists and dicts" in e.value.fix
    TrainerState(user={'ok': [np.float32(1.5), None, True, 'x', (1, 2)]}).to_json()


def test_a_user_of_string_keys_at_any_depth_round_trips():
    s = TrainerState(user={'seeds': {'data': 7}, 'runs': [{'a': 1}], 'betas': (0.9, 0.99)})
    back = TrainerState.from_json(s.to_json())
    assert back.user == {'seeds': {'data': 7}, 'runs': [{'a': 1}], 'betas': [0.9, 0.99]}

@pytest.mark.parametrize('text,message', [
    ('{', 'trainer state is not valid JSON'),
    ('', 'trainer state is not valid JSON'),
    ('[1, 2]', 'trainer state is not a JSON object'),
    ('"state"', 'trainer state is not a JSON object'),
    ('{"dp": 0}', 'invalid trainer state: TrainerState.dp must be at least 1'),
    ('{"global_step": -3}', 'invalid trainer state: TrainerState.global_step must be'),
    ('{"user": 5}', 'invalid trainer state: TrainerState.user must be a mapping'),
])
def test_from_json_refuses_with_a_format_error_naming_the_file(text, message):
    with pytest.raises(FormatError, match=message) as info:
        TrainerState.from_json(text, file='run/step_00000010.jckpt')
    assert info.value.file == 'run/step_00000010.jckpt' and info.value.fix
    assert str(info.value).startswith('run/step_00000010.jckpt: ')


@pytest.mark.parametrize('text', ['{"user": 5, "epoch": 1}', '{"user": null, "epoch": 1}'])
def test_from_json_refuses_a_bad_user_beside_unknown_fields(text):
    with pytest.raises(FormatError, match='invalid trainer state') as info:
        TrainerState.from_json(text, file='s.jckpt')
    assert info.value.file == 's.jckpt'


# --- check_layout ------------------------------------------------------------------------------

def test_the_same_layout_returns_the_stored_state():
    s = TrainerState(global_step=3, dp=2, tp=2)
    assert s.check_layout((2, 2, 1), reshard=False) is s
    assert s.check_layout([2, 2, 1], reshard=True) is s
    assert s.check_layout(TrainerState(dp=2, tp=2, global_step=99), reshard=False) is s


def test_another_layout_is_refused_without_reshard():
    s = TrainerState(global_step=3, dp=2)
    with pytest.raises(MismatchError, match='written with dp=2 tp=1 pp=1, this run uses '
                                            'dp=8 tp=1 pp=1') as info:
        s.check_layout((8, 1, 1), reshard=False, file='ckpt.jckpt')
    assert info.value.file == 'ckpt.jckpt' and 'reshard=True' in info.value.fix


def test_another_layout_is_adopted_with_reshard():
    s = TrainerState(global_step=3, learning_rate=0.1, dp=2, user={'seed': 1})
    out = s.check_layout(TrainerState(dp=1, tp=4, pp=2), reshard=True)
    assert out.layout == (1, 4, 2)
    assert out == s.replace(dp=1, tp=4, pp=2)
    assert s.layout == (2, 1, 1)


@pytest.mark.parametrize('layout', [(2, 1), (2, 1, 1, 1), (0, 1, 1), (2.0, 1, 1), ('2', 1, 1)])
@pytest.mark.parametrize('reshard', [False, True])
def test_a_bad_layout_is_refused(layout, reshard):
    with pytest.raises(InputError, match=r'layout must be \(dp, tp, pp\) positive integers'):
        TrainerState().check_layout(layout, reshard=reshard)


def test_replace_and_from_json_refuse_bad_arguments():
    with pytest.raises(InputError, match="TrainerState has no field 'step'") as err:
        TrainerState().replace(step=1)
    assert "global_step" in err.value.fix
    with pytest.raises(InputError, match="from_json takes the JSON text"):
        TrainerState.from_json(5)


def test_a_number_past_floats_range_is_refused_not_an_overflow():
    """A crafted record's learning rate of 10**400 raised a bare OverflowError on restore."""
    with pytest.raises(jckpt.CheckpointError):
        jckpt.TrainerState.from_json('{"learning_rate": 1' + '0' * 400 + '}')
    with pytest.raises(jckpt.InputError, match="learning_rate"):
        jckpt.TrainerState(learning_rate=10 ** 400)


def test_a_lone_surrogate_in_user_is_refused_where_it_sits(tmp_path):
    """`user={'path': os.fsdecode(b'\\xff')}` was taken, the step saved, and its trainer state
    then refused as damaged JSON (a safetensors step: a bare ValueError)."""
    for user, where in (({'a': 'b\ud800'}, "user['a']"), ({'x': ['ok', {'k\udcff': 1}]}, "user['x'][1] key")):
        with pytest.raises(InputError, match="lone surrogate") as e:
            TrainerState(user=user)
        assert e.value.message.startswith(f"TrainerState.{where} (") and 'surrogateescape' in e.value.fix
    state = TrainerState(user={'path': 'ünï ✓'})
    with jckpt.CheckpointManager(tmp_path, asynchronous=False) as mgr:
        mgr.save(1, {'w': np.ones(2)}, trainer_state=state)
        assert mgr.restore(target={'w': np.ones(2)}).trainer_state == state


def test_a_state_with_user_fields_is_a_hashable_value_of_its_own():
    """`hash(TrainerState(user={...}))` raised `TypeError: unhashable type: 'dict'` (a frozen
    dataclass hashes its fields), and a state changed with the dict the caller went on
    changing: equal states now hash alike, and the state keeps a copy of `user`."""
    seen = {'seed': 0, 'order': [1, 2]}
    a = TrainerState(global_step=3, user=seen)
    b = TrainerState(global_step=3, user={'seed': 0, 'order': [1, 2]})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert {a: 'x'}[b] == 'x'
    seen['seed'] = 1
    seen['order'].append(3)
    assert a.user == {'seed': 0, 'order': [1, 2]} and a == b
    assert a != a.replace(user={'seed': 1}) and hash(TrainerState()) == hash(TrainerState(user={}))
