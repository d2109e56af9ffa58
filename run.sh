#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv (pip resolves torch with torchvision), then
#   bash run.sh demo   runs the main job on built-in small data
#   bash run.sh test   runs the test suite
set -euo pipefail
cd "$(dirname "$0")"
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
fi
if ! "$VENV/bin/python" -c "import ls_hf, ls_timm, pytest, matplotlib, psutil" >/dev/null 2>&1; then
    echo "run.sh: installing torch, Transformers, timm and the test tools into $VENV/ (first run only: several" \
         "minutes and about 6 GB, CUDA libraries included)..." >&2
    "$VENV/bin/pip" install -q -e ".[test,bench]"
    echo "run.sh: $VENV/ is ready; 'source $VENV/bin/activate' gives ls-convert-roberta and python -m recipes.*" >&2
fi
case "${1:-}" in
    demo) shift; exec "$VENV/bin/python" -m recipes.demo "$@" ;;
    # two pytest workers, one thread each: the two cores without oversubscription
    test) shift; OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" exec "$VENV/bin/python" -m pytest -q -n 2 "$@" ;;
    *) echo "usage: bash run.sh demo|test [args]" >&2; exit 2 ;;
esac
