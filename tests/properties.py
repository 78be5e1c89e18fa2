"""What the property-based test modules share: how many examples they run and what they store.

The examples are few and derandomized, so CI is reproducible; hunt with more by setting
`JCKPT_PROPERTY_EXAMPLES` (e.g. `JCKPT_PROPERTY_EXAMPLES=2000 pytest tests/system/test_properties.py`).
"""

import os

from hypothesis import HealthCheck, Phase, settings

from jckpt.format import precs

EXAMPLES = int(os.environ.get("JCKPT_PROPERTY_EXAMPLES", "25"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 100,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])

#: Every dtype a checkpoint stores as an array (not the opaque `Void_prec`, nor the
#: `Uint4x32_prec` of typed keys, which come from key arrays).
STORED_DTYPES = [precs.dtype_of(p)
                 for p in sorted(precs.ALL_PRECS - {"Void_prec", "Uint4x32_prec"})]

#: Stateful tests run `examples * STATES_SCALE` sequences: 1 in CI (derandomized), more by
#: hand (`JCKPT_STATES_SCALE=20`); `JCKPT_STATES_SHRINK=0` reports a failure as found
#: instead of shrinking it for minutes.
STATES_SCALE = int(os.environ.get("JCKPT_STATES_SCALE", "1"))
STATES_SHRINK = os.environ.get("JCKPT_STATES_SHRINK", "1") != "0"


def state_settings(examples: int, steps: int) -> settings:
    """The settings of a stateful test of `examples` sequences (times the scale) of `steps`."""
    return settings(max_examples=examples * STATES_SCALE, stateful_step_count=steps,
                    deadline=None, suppress_health_check=list(HealthCheck),
                    derandomize=STATES_SCALE == 1, database=None,
                    phases=[p for p in Phase if p is not Phase.shrink or STATES_SHRINK])
