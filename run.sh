#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv (pip resolves torch with torchvision), then
#   bash run.sh demo        runs the main job on built-in small data
#   bash run.sh test        runs the quick tier of the test suite (every module, recipe and attention path);
#                           bash run.sh test --all adds the slow tests (marked slow: compiling, ONNX export)
#   bash run.sh gpu-check   on a CUDA machine: the tests that take the device (tests/device_tests.txt) on CUDA in
#                           float32 and in bfloat16, then each benchmark in bench/ on CUDA in bfloat16, each printing
#                           its table (JSON in bench/results/). Without a GPU it says so and exits 0
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-}" in  # an unknown command is refused before anything is created or installed
    demo|test|gpu-check) ;;
    *) echo "usage: bash run.sh demo|test|gpu-check [args]${1:+, got '$1'}" >&2; exit 2 ;;
esac
if [ "$1" = gpu-check ]; then
    if [ "$#" -gt 1 ]; then
        echo "usage: bash run.sh gpu-check (no arguments), got '${*:2}'" >&2
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
    test)
        shift
        tier=(-m "not slow")  # a later -m of the caller's takes its place
        if [ "${1:-}" = --all ]; then
            shift
            tier=()
            echo "run.sh test: every test, the slow ones too: about 12 minutes on 2 cores" >&2
        elif [[ " $* " != *" -m "* ]]; then
            echo "run.sh test: the quick tier, about 4 minutes on 2 cores; 'bash run.sh test --all' adds the slow" \
                 "tests (about 12 minutes in all)" >&2
        fi
        # two pytest workers, one thread each: the two cores without oversubscription
        OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" exec "$VENV/bin/python" -m pytest -q -n 2 ${tier[@]+"${tier[@]}"} "$@"
        ;;
    gpu-check)
        if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
            echo "run.sh gpu-check: nvidia-smi sees a GPU but torch in $VENV/ has no CUDA; install a CUDA build of" \
                 "torch (pip install torch --index-url https://download.pytorch.org/whl/cu128, say)." >&2
            exit 1
        fi
        status=0
        for dtype in float32 bfloat16; do
            echo "run.sh gpu-check: the device tests on CUDA in $dtype"
            # four workers share the GPU, with one compile thread each
            LS_TEST_DEVICE=cuda LS_TEST_DTYPE=$dtype TORCHINDUCTOR_COMPILE_THREADS=1 \
                "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n 4 @tests/device_tests.txt || status=1
        done
        benchmark() {  # python -m bench.<$1> with the other arguments, on CUDA in bfloat16
            echo "run.sh gpu-check: python -m bench.$* --device cuda --dtype bf16"
            "$VENV/bin/python" -m "bench.$1" "${@:2}" --device cuda --dtype bf16 || status=1
        }
        benchmark bench_attention --max-n 65536
        benchmark bench_models --layers 12 --lengths 4096 16384 --batch 2 --optimizer-step --contexts 512 8192 \
            --peers long-short roberta-sdpa longformer modernbert
        benchmark bench_vision --batch 32 --resolutions 224 448 --train-resolutions 224 448 \
            --models cvt_ls_13 hf_cvt_13 deit_small_patch16_224
        benchmark bench_vision --batch 32 --resolutions 224 448 --train-resolutions 224 448 \
            --models vil_ls_medium swin_small_patch4_window7_224 --out bench/results/vision_cuda_bf16_vil_ls.json
        benchmark bench_limits --budgets memory --memory-gib 16
        exit "$status"
        ;;
esac
