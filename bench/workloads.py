"""The benchmark workloads: pytrees of host arrays, built deterministically (no downloads).

Each builder returns a nested dict of numpy arrays; the runner moves them to
JAX arrays once, outside every timed region, since that is what a JAX user
saves.

>>> tree = build('small', quick=True)
>>> len(tree), next(iter(tree.values())).dtype
(200, dtype('float32'))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

#: GPT-2 124M (Hugging Face naming): vocabulary, context, width, layers.
GPT2 = {'vocab': 50257, 'ctx': 1024, 'width': 768, 'layers': 12}


def _rng() -> np.random.Generator:
    return np.random.default_rng(0)


def large(quick: bool = False) -> dict[str, np.ndarray]:
    """About 1 GiB (quick: 8 MiB) in 8 float32 arrays."""
    n = (1 << 18) if quick else (1 << 25)
    rng = _rng()
    return {f"layer{i}": rng.random((n // 1024, 1024), dtype=np.float32) for i in range(8)}


def small(quick: bool = False) -> dict[str, np.ndarray]:
    """2,000 (quick: 200) float32 arrays of 1,000 elements."""
    rng = _rng()
    return {f"w{i:04d}": rng.random(1000, dtype=np.float32) for i in range(200 if quick else 2000)}


def tiny(quick: bool = False) -> dict[str, dict[str, np.ndarray]]:
    """100,000 (quick: 2,000) arrays of 4 float32 in 100 groups: the header dominates."""
    count = 2000 if quick else 100_000
    flat = np.arange(count * 4, dtype=np.float32).reshape(count, 4)
    groups = 100
    per = count // groups
    return {f"g{g:03d}": {f"t{i:04d}": flat[g * per + i].copy() for i in range(per)}
            for g in range(groups)}


def gpt2_params(width: int, layers: int, vocab: int, ctx: int, dtype: Any,
                rng: np.random.Generator) -> dict[str, Any]:
    """A GPT-2-shaped parameter tree (flax's naming), random values of ``dtype``."""
    def w(*shape):
        return rng.random(shape, dtype=np.float32).astype(dtype, copy=False)

    def ln():
        return {'scale': w(width), 'bias': w(width)}

    def dense(i, o):
        return {'kernel': w(i, o), 'bias': w(o)}

    blocks = {f"h{i}": {'ln_1': ln(), 'attn': {'c_attn': dense(width, 3 * width),
                                                'c_proj': dense(width, width)},
                         'ln_2': ln(), 'mlp': {'c_fc': dense(width, 4 * width),
                                               'c_proj': dense(4 * width, width)}}
              for i in range(layers)}
    return {'wte': w(vocab, width), 'wpe': w(ctx, width), **blocks, 'ln_f': ln()}


def gpt2(quick: bool = False) -> dict[str, Any]:
    """GPT-2 124M-shaped parameters in bfloat16 plus Adam state (mu, nu) in float32.

    Quick mode keeps the structure (148 parameter arrays per tree) at width 64.
    """
    dims = dict(GPT2, width=64, vocab=512, ctx=64) if quick else GPT2
    rng = _rng()
    params = gpt2_params(dtype=ml_dtypes.bfloat16, rng=rng, **dims)
    mu = gpt2_params(dtype=np.float32, rng=rng, **dims)
    nu = gpt2_params(dtype=np.float32, rng=rng, **dims)
    return {'params': params,
            'opt_state': {'count': np.array(1000, np.int32), 'mu': mu, 'nu': nu}}


WORKLOADS: dict[str, Callable[[bool], Any]] = {
    'large': large, 'small': small, 'tiny': tiny, 'gpt2': gpt2,
}

#: Default repetitions per workload (the 1 GiB ones take a while per tool).
REPS = {'large': 3, 'small': 5, 'tiny': 3, 'gpt2': 3}

#: Tools left out of a workload, and why (the report prints the reason).
SKIP = {'tiny': {t: "not run: about 1 ms per array (see 'small'), so 100,000 arrays take minutes "
                    "per operation" for t in ('orbax', 'orbax-nozstd')}}

DESCRIPTIONS = {
    'large': '8 float32 arrays, 1 GiB in all',
    'small': '2,000 float32 arrays of 1,000 elements (8 MB)',
    'tiny': '100,000 float32 arrays of 4 elements (header-bound)',
    'gpt2': 'GPT-2 124M: bfloat16 parameters + float32 Adam mu and nu (1.24 GB)',
}


def build(name: str, quick: bool = False) -> Any:
    """The workload ``name`` as a nested dict of numpy arrays."""
    return WORKLOADS[name](quick)
