"""What the property-based test modules share: how many examples they run and what they store.

The examples are few and derandomized, so CI is reproducible; hunt with more by setting
`JCKPT_PROPERTY_EXAMPLES` (e.g. `JCKPT_PROPERTY_EXAMPLES=2000 pytest tests/system/test_properties.py`).
"""

import os

from hypothesis import HealthCheck, settings

from jckpt.format import precs

EXAMPLES = int(os.environ.get("JCKPT_PROPERTY_EXAMPLES", "25"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 100,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])

#: Every dtype a checkpoint stores as an array (not the opaque `Void_prec`, nor the
#: `Uint4x32_prec` of typed keys, which come from key arrays).
STORED_DTYPES = [precs.dtype_of(p)
                 for p in sorted(precs.ALL_PRECS - {"Void_prec", "Uint4x32_prec"})]
