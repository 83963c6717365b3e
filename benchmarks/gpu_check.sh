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
#   benchmarks/gpu_check.sh [--dry-run] [--out DIR] [--steps N] [--problems a,b] [--python PY] [--wheels DIR]
#
#   --dry-run    print what would run (and check the benchmark's plan) without a GPU
#   --out DIR    where the logs, the JSON and the markdown table go (default: $OUT or
#                benchmarks/results/gpu_check)
#   --steps N    timed steps per child (default 10; full every 10th times whole periods)
#   --problems   default gpt,resnet,gpt2-small
#   --python     the interpreter (default: $PYTHON, else python)
#   --wheels DIR where the interpreter cannot import BackPACK (a GPU machine with PyTorch but no
#                network), install the wheels in DIR into a folder of their own first (--no-deps
#                --no-index); made here with
#                pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#                    --platform manylinux2014_x86_64 -d DIR backpack-for-pytorch==1.7.1 unfoldNd
#
# Time limits: the tests 90 s, the benchmark 110 s for gpt, 90 s for resnet and 150 s for gpt2-small
# (each child at most 60 s), 440 s in all, so the whole check stays under 8 minutes even when a
# step hangs. On an H200 (2026-11-27) the tests took 33 s, and each child 11-36 s, most of it the
# import of torch and transformers: gpt's four children 80 s, resnet's 49 s, gpt2-small's 97 s.
# The benchmark writes its JSON and table after every child process, so a problem cut off by its
# limit keeps what was measured before; every problem's figures are merged into one JSON.
# Paths with spaces are not supported (the benchmark command is word-split).
set -u

dry_run=0
out="${OUT:-}"
steps=10
problems="gpt,resnet,gpt2-small"
python="${PYTHON:-python}"
wheels=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1; shift ;;
        --out) out="${2:?--out needs a directory}"; shift 2 ;;
        --steps) steps="${2:?--steps needs a number}"; shift 2 ;;
        --problems) problems="${2:?--problems needs a list}"; shift 2 ;;
        --python) python="${2:?--python needs an interpreter}"; shift 2 ;;
        --wheels) wheels="${2:?--wheels needs a directory}"; shift 2 ;;
        -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case "$steps" in
    ''|*[!0-9]*) echo "gpu_check.sh: --steps must be a positive integer, got '$steps'" >&2; exit 2 ;;
esac

root="$(cd "$(dirname "$0")/.." && pwd)"
out="${out:-$root/benchmarks/results/gpu_check}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" MPLBACKEND=Agg

tests=(timeout 90 "$python" -m pytest -q -p no:cacheprovider "$root/tests/test_cuda.py")
# one benchmark run per problem, each under its own limit, merged into one JSON: a problem that runs out
# of time loses only its own figures (gpt2-small gets the most: 124M parameters)
bench_command() {  # $1 = problem
    echo "$python" "$root/benchmarks/overhead.py" --device cuda --problems "$1" \
        --configs economy,full_every10 --quantities none --rounds 1 --steps "$steps" --warmup 2 \
        --timeout 60 --budget 20 --no-docs --out "$out/overhead_cuda.json" --merge "$out/overhead_cuda.json" \
        --table "$out/overhead_cuda.md"
}
limit_of() { case "$1" in gpt2-small) echo 150 ;; gpt) echo 110 ;; *) echo 90 ;; esac; }
IFS=, read -r -a problem_list <<< "$problems"

if [ "$dry_run" = 1 ]; then
    echo "would run: ${tests[*]}"
    for problem in "${problem_list[@]}"; do
        echo "would run: timeout $(limit_of "$problem") $(bench_command "$problem")"
        # the benchmark checks its own arguments and prints its plan (no GPU needed)
        $(bench_command "$problem") --dry-run || exit $?
    done
    exit 0
fi

mkdir -p "$out"
if ! "$python" -c "import backpack" 2>/dev/null; then
    if [ -z "$wheels" ]; then
        echo "gpu_check.sh: $python cannot import backpack; pass --wheels DIR (see --help)" >&2
        exit 2
    fi
    site="$(mktemp -d)"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl || exit 2
    export PYTHONPATH="$PYTHONPATH:$site"
fi
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
    "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA')"
} | tee "$out/device.txt"

start=$(date +%s)
"${tests[@]}" 2>&1 | tee "$out/test_cuda.log"
tests_rc=${PIPESTATUS[0]}
echo "tests: exit $tests_rc after $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"

bench_rc=0
for problem in "${problem_list[@]}"; do
    start=$(date +%s)
    timeout "$(limit_of "$problem")" $(bench_command "$problem") 2>&1 | tee -a "$out/overhead_cuda.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || bench_rc=$rc
    echo "benchmark $problem: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
done

[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
