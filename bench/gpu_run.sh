#!/usr/bin/env bash
# One run on a machine with a GPU: the tests that touch devices, with the GPU as JAX's default
# backend (the CPU keeps its 8 virtual devices for the tests' meshes), then bench.gpu and
# bench.gpu_small. Run from the repository root; results go to $OUT (default ./gpu-results).
#
#   bench/gpu_run.sh            # full sizes: 1 GiB state, 2,000 small arrays, 60 ms steps
#   bench/gpu_run.sh --quick    # a check that it runs (on a CPU too), in a minute or two
#
# Environment: TEST_PLATFORMS (default cuda,cpu when JAX sees a GPU, else cpu), TEST_TIMEOUT
# (seconds for the tests, default 240), BENCH_ARGS (more arguments for bench.gpu, e.g. --gib 1,4).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
QUICK=()
[ "${1:-}" = "--quick" ] && QUICK=(--quick)
status=0

{ date -u; nvidia-smi 2>&1 || echo "no nvidia-smi"; python -c 'import jax; print(jax.__version__, jax.devices())'
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

if [ -z "${TEST_PLATFORMS:-}" ]; then
    if python -c 'import jax; jax.devices("gpu")' >/dev/null 2>&1; then TEST_PLATFORMS=cuda,cpu
    else TEST_PLATFORMS=cpu; fi
fi
TESTS=(tests/trees tests/api tests/services tests/adapters/test_orbax.py tests/adapters/test_safetensors.py
       tests/tools/test_consolidate.py tests/system/test_stacks.py tests/system/test_any_backend.py)
[ ${#QUICK[@]} -gt 0 ] && TESTS=(tests/trees tests/system/test_any_backend.py)
# Several test processes share the GPU: none takes 75% of its memory up front.
PARALLEL=()
python -c 'import xdist' >/dev/null 2>&1 && PARALLEL=(-n 4)
echo "== tests, JAX_PLATFORMS=$TEST_PLATFORMS ${PARALLEL[*]}: ${TESTS[*]}"
JAX_PLATFORMS="$TEST_PLATFORMS" XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-240}" \
    python -m pytest -q -x -p no:cacheprovider "${PARALLEL[@]}" "${TESTS[@]}" >"$OUT/tests.txt" 2>&1 || status=1
tail -n 15 "$OUT/tests.txt"

echo "== bench.gpu ${QUICK[*]} ${BENCH_ARGS:-}"
# shellcheck disable=SC2086
python -m bench.gpu "${QUICK[@]}" ${BENCH_ARGS:-} --json "$OUT/gpu.json" >"$OUT/gpu.md" 2>&1 || status=1
tail -n 30 "$OUT/gpu.md"

echo "== bench.gpu_small"
SMALL=()
[ ${#QUICK[@]} -gt 0 ] && SMALL=(200 1000 2)
python -m bench.gpu_small "${SMALL[@]}" >"$OUT/gpu_small.json" 2>&1 || status=1
cat "$OUT/gpu_small.json"
exit $status
