#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv (pip resolves torch with torchvision), then
#   bash run.sh demo   runs the main job on built-in small data
#   bash run.sh test   runs the test suite
#   bash run.sh gpu-check [tests [float32|bfloat16]|bench|profile]   on a CUDA machine, each part within 5 minutes:
#                      'tests' runs the tests that take the device (tests/device_tests.txt) on CUDA in float32 and
#                      bfloat16 side by side for at most GPU_CHECK_TIME_LIMIT s, 270 (each outcome logged as it
#                      finishes in GPU_CHECK_LOG_DIR, default bench/results/); 'bench' runs bench.gpu_bars, the GPU
#                      targets within the same budget, compiling included (one table with each ratio and whether it is
#                      met; JSON in bench/results/ and in GPU_CHECK_LOG_DIR); 'profile' runs bench.profile_attention
#                      (where the time goes: the 1-D layer and cvt_ls_13's inference and training, at most 100 s each,
#                      into GPU_CHECK_LOG_DIR); without a part, all three in turn; 'tests <dtype>' one precision. It
#                      first says which declared dependencies the environment (VENV, default .venv) lacks, and refuses
#                      when the check needs one. Without a GPU it says so and exits 0
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-}" in  # an unknown command is refused before anything is created or installed
    demo|test|gpu-check) ;;
    *) echo "usage: bash run.sh demo|test|gpu-check [args]${1:+, got '$1'}" >&2; exit 2 ;;
esac
if [ "$1" = gpu-check ]; then
    part="${2:-all}" dtypes="${3:-float32 bfloat16}"
    usage="usage: bash run.sh gpu-check [tests [float32|bfloat16]|bench|profile] (all when omitted)"
    if [ "$part" != all ] && [ "$part" != tests ] && [ "$part" != bench ] && [ "$part" != profile ]; then
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
    if [ -x "${VENV:-.venv}/bin/python" ]; then  # an environment made without run.sh is checked before any work
        "${VENV:-.venv}/bin/python" -m bench.dependencies || exit 1
        dependencies_checked=1
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
        [ -n "${dependencies_checked:-}" ] || "$VENV/bin/python" -m bench.dependencies || exit 1
        log_dir="${GPU_CHECK_LOG_DIR:-bench/results}" limit="${GPU_CHECK_TIME_LIMIT:-270}"
        mkdir -p "$log_dir"
        status=0
        if [ "$part" = all ] || [ "$part" = tests ]; then
            pids=()
            for dtype in $dtypes; do  # the precisions side by side: GPU_CHECK_WORKERS pytest workers each
                log="$log_dir/gpu_check_tests_$dtype.log"
                echo "run.sh gpu-check: tests on CUDA in $dtype, each outcome in $log as it finishes (at most ${limit} s)"
                # -v logs each outcome as it finishes, so a run stopped at the limit (SIGINT: pytest still prints its
                # summary) names what ran; one compile thread per worker, the workers being many; the file list
                # expanded here, for any pytest version
                # shellcheck disable=SC2046
                LS_TEST_DEVICE=cuda LS_TEST_DTYPE=$dtype TORCHINDUCTOR_COMPILE_THREADS=1 timeout -s INT -k 15 "$limit" \
                    "$VENV/bin/python" -m pytest -v -p no:cacheprovider --durations=15 -n "${GPU_CHECK_WORKERS:-6}" \
                    $(cat tests/device_tests.txt) > "$log" 2>&1 &
                pids+=("$!")
            done
            for pid in "${pids[@]}"; do
                wait "$pid" || status=1
            done
            for dtype in $dtypes; do
                log="$log_dir/gpu_check_tests_$dtype.log"
                echo "run.sh gpu-check: $dtype ($log):"
                grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed|errors?)|no tests ran" "$log" || echo "  no summary"
                if grep -q KeyboardInterrupt "$log"; then
                    echo "  stopped after ${limit} s (GPU_CHECK_TIME_LIMIT): the tests the log does not name did not run"
                fi
            done
        fi
        if [ "$part" = all ] || [ "$part" = bench ]; then
            # the bars, compiling included, within the same limit; the table at the end, JSON in bench/results/ and in
            # the log folder, both written after each section; stopped 30 s after the budget should a section
            # overrun it (a compilation under way may hold off the section's alarm), keeping what was measured
            timeout -s INT -k 15 "$((limit + 30))" \
                "$VENV/bin/python" -m bench.gpu_bars --budget-s "$limit" --copy-to "$log_dir" || status=1
        fi
        if [ "$part" = all ] || [ "$part" = profile ]; then
            # where the time goes: the attention layer at 4k tokens, batch 8, beside the window's kernel; cvt_ls_13
            # beside Transformers' CvT-13 at 224, batch 32, each stage's attention layers timed; its training steps on
            # FlexAttention and on the Triton window kernels
            profiles=("attention --n 4096 --batch 8"
                "vision --vision cvt_ls_13 cvt_ls_13-triton hf_cvt_13 --resolution 224 --batch 32"
                "vision-train --vision cvt_ls_13 cvt_ls_13-triton --train --resolution 224 --batch 32")
            for profile in "${profiles[@]}"; do  # a name, then bench.profile_attention's arguments
                name="${profile%% *}"
                echo "run.sh gpu-check: profiling $name (at most 100 s): $log_dir/profile_${name}_cuda.txt"
                # shellcheck disable=SC2086
                timeout 100 "$VENV/bin/python" -m bench.profile_attention ${profile#* } \
                    --out "$log_dir/profile_${name}_cuda.txt" > "$log_dir/profile_$name.log" 2>&1 \
                    || { echo "run.sh gpu-check: the $name profile did not finish (see its log)"; status=1; }
            done
        fi
        exit "${status:-0}"
        ;;
esac
