#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv (pip resolves torch with torchvision), then
#   bash run.sh demo   runs the main job on built-in small data
#   bash run.sh test   runs the test suite
#   bash run.sh gpu-check [tests [float32|bfloat16]|bench]   on a CUDA machine: the attention, model and timm tests
#                      on CUDA (float32, bfloat16; every test's outcome logged as it finishes, in GPU_CHECK_LOG_DIR,
#                      default bench/results/), then bench_attention (bf16, n up to 65,536) and bench_models on CUDA,
#                      JSON under bench/results/; 'tests' or 'bench' runs one half, 'tests <dtype>' one precision of
#                      the tests; without a GPU it says so and exits 0
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-}" in  # an unknown command is refused before anything is created or installed
    demo|test|gpu-check) ;;
    *) echo "usage: bash run.sh demo|test|gpu-check [args]${1:+, got '$1'}" >&2; exit 2 ;;
esac
if [ "$1" = gpu-check ]; then
    part="${2:-all}" dtypes="${3:-float32 bfloat16}"
    usage="usage: bash run.sh gpu-check [tests [float32|bfloat16]|bench] (all when omitted)"
    if [ "$part" != all ] && [ "$part" != tests ] && [ "$part" != bench ]; then
        echo "$usage, got '$part'" >&2
        exit 2
    fi
    if [ -n "${3:-}" ] && { [ "$part" != tests ] || { [ "$3" != float32 ] && [ "$3" != bfloat16 ]; }; }; then
        echo "$usage: a precision follows 'tests' and is float32 or bfloat16, got '$part $3'" >&2
        exit 2
    fi
    if ! { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
        echo "run.sh gpu-check: no GPU found (no NVIDIA driver answers nvidia-smi); nothing to check on this machine."
        exit 0
    fi
fi
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "run.sh: creating $VENV/ and updating its pip..." >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
fi
if ! "$VENV/bin/python" -c "import ls_hf, ls_timm, pytest, matplotlib, psutil" >/dev/null 2>&1; then
    echo "run.sh: installing torch, Transformers, timm and the test tools into $VENV/ (first run only: several" \
         "minutes and about 6 GB, CUDA libraries included); pip's progress follows" >&2
    "$VENV/bin/pip" install --progress-bar on -e ".[test,bench]"
    echo "run.sh: $VENV/ is ready; 'source $VENV/bin/activate' gives ls-convert-roberta and python -m recipes.*" >&2
fi
case "${1:-}" in
    demo) shift; exec "$VENV/bin/python" -m recipes.demo "$@" ;;
    # two pytest workers, one thread each: the two cores without oversubscription
    test) shift; OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" exec "$VENV/bin/python" -m pytest -q -n 2 "$@" ;;
    gpu-check)
        if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
            echo "run.sh gpu-check: nvidia-smi sees a GPU but torch in $VENV/ has no CUDA; install a CUDA build of" \
                 "torch (pip install torch --index-url https://download.pytorch.org/whl/cu128, say)." >&2
            exit 1
        fi
        if [ "$part" != bench ]; then
            log_dir="${GPU_CHECK_LOG_DIR:-bench/results}"
            mkdir -p "$log_dir"
            status=0
            for dtype in $dtypes; do
                log="$log_dir/gpu_check_tests_$dtype.log"
                echo "run.sh gpu-check: tests on CUDA in $dtype, each outcome in $log"
                # workers share the GPU; the compiled cases (Triton builds) and the property tests take most of the
                # time. -v writes each test's outcome as it finishes, so a run cut short still names its failures.
                LS_TEST_DEVICE=cuda LS_TEST_DTYPE=$dtype "$VENV/bin/python" -m pytest -v -p no:cacheprovider \
                    --durations=15 -n "${GPU_CHECK_WORKERS:-4}" @tests/device_tests.txt > "$log" 2>&1 || status=1
                grep -E "FAILED|ERROR|[0-9]+ (passed|failed)" "$log" || true
            done
            [ "$part" = tests ] && exit "$status"
        fi
        "$VENV/bin/python" -m bench.bench_attention --device cuda --dtype bf16 --max-n 65536 \
            --peers long-short sdpa flex-window longformer   # bench/results/attention_cuda_bf16.json
        "$VENV/bin/python" -m bench.bench_models --device cuda --dtype bf16 --lengths 4096 16384 \
            --layers 2   # bench/results/models_cuda_bf16.json
        exit "${status:-0}"
        ;;
esac
