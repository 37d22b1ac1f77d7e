#!/usr/bin/env bash
# bench/device.sh [--quick]: the one prepared run for a machine with a GPU; also runs on a CPU (--quick).
#
# Writes under $OUT (default .device-out/): tables.md (every table, as each step ends), device.log (all
# output) and pytest.log. Each step runs under its own time limit, so one that stalls costs only itself,
# and the steps that decide the most come first. On an H200 the whole run takes at most 10 minutes.
#
# Where .venv exists (here: `make install`), it is used as is. Elsewhere (the device machine, which reaches
# no package registry) the wheels and the SmolLM2 folder staged by bench/device_stage.sh in .gpu/ are
# unpacked and installed into /tmp/site, beside the image's own packages (its python3 holds numpy,
# transformers, tokenizers and the CUDA 13 libraries that MLX's CUDA build loads).
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/.device-out}
mkdir -p "$OUT"
QUICK=""
[ "${1:-}" = "--quick" ] && QUICK="--quick"
# --focus: what fits in about four minutes (what is left of a lease after a full run went wrong).
[ "${1:-}" = "--focus" ] && QUICK="--focus"
LOG=$OUT/device.log
TABLES=$OUT/tables.md
: >"$LOG"
: >"$TABLES"
export PYTHONUNBUFFERED=1

say() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

if [ -x .venv/bin/python ]; then
    PY=$REPO/.venv/bin/python
    # The CPU's fast BLAS, as `make test` runs it (common/cpu_blas.py).
    eval "export $($PY -m common.cpu_blas)" 2>/dev/null || true
else
    PY=python3
    STAGE=/tmp/stage
    PIECES=${PIECES:-.gpu}  # where the pieces are (the calls that carried them may have copied them elsewhere)
    if [ ! -f $STAGE/unpacked ]; then
        say "unpacking $PIECES/p*/part.*"
        mkdir -p $STAGE
        cat "$PIECES"/p*/part.* | tar -x -C $STAGE || { say "the pieces do not make a whole archive"; ls -laR "$PIECES" >>"$LOG"; exit 3; }
        touch $STAGE/unpacked
    fi
    say "installing $(ls $STAGE/wheels | wc -l) wheels into /tmp/site"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $STAGE/wheels/*.whl >>"$LOG" 2>&1 || { say "pip failed"; tail -20 "$LOG"; exit 3; }
    # libmlx.so looks for the CUDA libraries at ../../nvidia/{cu13,cublas,...}/lib: the image's own.
    NV=$($PY -c 'import nvidia; print(" ".join(nvidia.__path__))' 2>/dev/null)
    for dir in $NV; do [ -e /tmp/site/nvidia ] || ln -s "$dir" /tmp/site/nvidia; done
    LIBS=$(ls -d /tmp/site/nvidia/*/lib 2>/dev/null | tr '\n' ':')
    export LD_LIBRARY_PATH=${LIBS}${LD_LIBRARY_PATH:-}
    [ -d /usr/local/cuda ] && export CUDA_HOME=/usr/local/cuda CUDA_PATH=/usr/local/cuda
    export PYTHONPATH=/tmp/site:$REPO
    mkdir -p models
    [ -d models/smollm2 ] || cp -r $STAGE/smollm2 models/smollm2
fi

say "python: $($PY --version 2>&1), MLX:"
if ! $PY -c "import mlx.core as mx; print(mx.default_device(), mx.sum(mx.arange(10)).item())" >>"$LOG" 2>&1; then
    say "MLX does not run: the rest is skipped"
    $PY -c "import mlx, os; print(mlx.__path__)" >>"$LOG" 2>&1
    ldd /tmp/site/mlx/lib/libmlx.so >>"$LOG" 2>&1
    tail -40 "$LOG"
    exit 4
fi
tail -1 "$LOG"

# step NAME SECONDS COMMAND...: its output to the log, its tables (stdout) to tables.md.
step() {
    local name=$1 limit=$2
    shift 2
    say "$name (at most $limit s)"
    local started=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/.step" 2>>"$LOG"
    local rc=$?
    cat "$OUT/.step" >>"$TABLES"
    cat "$OUT/.step" >>"$LOG"
    rm -f "$OUT/.step"
    [ $rc -eq 0 ] || echo -e "\n**$name: stopped with status $rc$([ $rc -eq 124 ] && echo ', out of time')**\n" >>"$TABLES"
    say "$name: status $rc in $((SECONDS - started)) s"
}

if [ "$QUICK" = "--focus" ]; then
    step env 15 $PY -m bench.device env
    step new_shapes 40 $PY -m bench.device new_shapes
    step forward 45 $PY -m bench.device forward --focus
    step speculation 110 $PY -m bench.device speculation --focus
    step memory 25 $PY -m bench.device memory --focus
    step batching 60 $PY -m bench.device batching --focus
elif [ -n "$QUICK" ]; then
    for part in env new_shapes forward speculation batching memory prefill prompt_cache; do
        step "$part" 600 $PY -m bench.device "$part" --quick
    done
else
    # One kernel folder for the benches' processes and the supervisors' runners (its kernel_cache_dir
    # default), so a kernel compiled in one step is not compiled again in the next.
    export MLX_PTX_CACHE_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/mlxserve/kernels
    mkdir -p "$MLX_PTX_CACHE_DIR"
    step env 20 $PY -m bench.device env
    step new_shapes 50 $PY -m bench.device new_shapes
    step speculation_pair 120 $PY -m bench.device speculation_pair
    step speculation_smol 90 $PY -m bench.device speculation_smol
    step batching 130 $PY -m bench.device batching
    step memory 35 $PY -m bench.device memory
    step prefill 30 $PY -m bench.device prefill
    say "tests (at most 70 s)"
    timeout -k 5 70 $PY -m pytest -q -rfE -p no:cacheprovider tests/test_engine_decoding.py \
        tests/test_speculation.py tests/test_batching.py tests/test_release_rule.py \
        tests/test_engine_memory.py tests/test_prompt_cache.py >"$OUT/pytest.log" 2>&1
    say "tests: status $? ($(tail -1 "$OUT/pytest.log"))"
    echo -e "## tests on this device\n\n\`$(tail -1 "$OUT/pytest.log")\`\n" >>"$TABLES"
    step prompt_cache 40 $PY -m bench.device prompt_cache
    echo "kernels compiled: $(ls "$MLX_PTX_CACHE_DIR" | wc -l) files, $(du -sh "$MLX_PTX_CACHE_DIR" | cut -f1)" | tee -a "$LOG" >>"$TABLES"
fi
say "done"
