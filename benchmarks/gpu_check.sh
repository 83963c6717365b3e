#!/usr/bin/env bash
# The prepared GPU check (issue 37, item 5): fits in 8 minutes on one GPU.
#
#   1. the CUDA tests (tests/test_cuda.py: the zoo on CUDA, per-sample statistics
#      against a loop of autograd.grad, the full preset with Hessian-vector products);
#   2. benchmarks/overhead.py --device cuda: plain, economy and full every 10th step
#      on gpt, resnet and gpt2-small, one round, with the peak
#      torch.cuda.max_memory_allocated of every child.
#
# Usage:
#   benchmarks/gpu_check.sh [--dry-run] [--out DIR] [--steps N] [--problems a,b] [--python PY]
#
#   --dry-run    print what would run (and check the benchmark's plan) without a GPU
#   --out DIR    where the logs, the JSON and the markdown table go (default: $OUT or
#                benchmarks/results/gpu_check)
#   --steps N    timed steps per child (default 10; full every 10th times whole periods)
#   --problems   default gpt,resnet,gpt2-small
#   --python     the interpreter (default: $PYTHON, else python)
#
# Time limits: the tests 180 s, the benchmark 270 s (each child at most 90 s), so the
# whole check stays under 8 minutes even when a step hangs; whatever finished is kept.
set -u

dry_run=0
out="${OUT:-}"
steps=10
problems="gpt,resnet,gpt2-small"
python="${PYTHON:-python}"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1; shift ;;
        --out) out="${2:?--out needs a directory}"; shift 2 ;;
        --steps) steps="${2:?--steps needs a number}"; shift 2 ;;
        --problems) problems="${2:?--problems needs a list}"; shift 2 ;;
        --python) python="${2:?--python needs an interpreter}"; shift 2 ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case "$steps" in
    ''|*[!0-9]*) echo "gpu_check.sh: --steps must be a positive integer, got '$steps'" >&2; exit 2 ;;
esac

root="$(cd "$(dirname "$0")/.." && pwd)"
out="${out:-$root/benchmarks/results/gpu_check}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" MPLBACKEND=Agg

tests=(timeout 180 "$python" -m pytest -q -p no:cacheprovider "$root/tests/test_cuda.py")
bench=(timeout 270 "$python" "$root/benchmarks/overhead.py" --device cuda --problems "$problems"
       --configs economy,full_every10 --quantities none --rounds 1 --steps "$steps" --warmup 2
       --timeout 90 --budget 20 --no-docs --out "$out/overhead_cuda.json" --table "$out/overhead_cuda.md")

if [ "$dry_run" = 1 ]; then
    echo "would run: ${tests[*]}"
    echo "would run: ${bench[*]}"
    # the benchmark checks its own arguments and prints its plan (no GPU needed)
    "${bench[@]:2}" --dry-run
    exit $?
fi

mkdir -p "$out"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
    "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA')"
} | tee "$out/device.txt"

start=$(date +%s)
"${tests[@]}" 2>&1 | tee "$out/test_cuda.log"
tests_rc=${PIPESTATUS[0]}
echo "tests: exit $tests_rc after $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"

start=$(date +%s)
"${bench[@]}" 2>&1 | tee "$out/overhead_cuda.log"
bench_rc=${PIPESTATUS[0]}
echo "benchmark: exit $bench_rc after $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"

[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
