#!/usr/bin/env bash
# The prepared GPU validation run (scripts/gpu_check.py says what it checks). On a lent
# GPU machine, from the repository root, after scripts/gpu_prepare.sh ran here:
#     bash scripts/gpu_check.sh                  # writes $OUT/ (or runs/gpu-check/)
#     bash scripts/gpu_check.sh --sections fidelity,engine   # rerun some sections
# On any machine, in a minute or two, with no GPU (what CI runs), on a trace slice:
#     python scripts/gpu_check.py slice --trace-dir ../shared/traces --out runs/slice.csv \
#         --num-requests 32 --max-model-len 256
#     bash scripts/gpu_check.sh --dry-run --trace runs/slice.csv --out runs/gpu-check-dry
# Checks its prerequisites first and says in one line what is missing. Where $OUT is set
# (the device machine), the results travel back as $OUT/gpu-check.tgz (everything),
# $OUT/gpu-results.md, $OUT/manifest.json and $OUT/console.log.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
export SERVELAB_GPU_CHECK_COMMAND="bash scripts/gpu_check.sh${*:+ $*}"  # for the manifest
DRY=0
WORK=""
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1; ARGS+=("$1") ;;
        --out) WORK="$2"; shift ;;
        --out=*) WORK="${1#--out=}" ;;
        *) ARGS+=("$1") ;;
    esac
    shift
done
if [ -z "$WORK" ]; then
    if [ -n "${OUT:-}" ]; then WORK=/tmp/gpu-check; else WORK="$ROOT/runs/gpu-check"; fi
fi

# simpy from the carried wheels when the interpreter lacks it
if ! "$PY" -P -c "import simpy" 2>/dev/null && ls .gpu/wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/servelab-gpu-site \
        .gpu/wheels/*.whl && export PYTHONPATH="/tmp/servelab-gpu-site${PYTHONPATH:+:$PYTHONPATH}"
fi
# servelab itself, uninstalled: the package-dir layout of pyproject.toml as links. (-P: the
# working directory's servelab/ folder, the core alone, must not shadow the package.)
if ! "$PY" -P -c "import servelab.simulator" 2>/dev/null; then
    FARM=/tmp/servelab-gpu-src
    rm -rf "$FARM" && mkdir -p "$FARM/servelab"
    for f in "$ROOT"/servelab/*; do ln -s "$f" "$FARM/servelab/"; done
    for pkg in memory policies simulator backends traces reports validation sweeps; do
        ln -s "$ROOT/$pkg" "$FARM/servelab/$pkg"
    done
    export PYTHONPATH="$FARM${PYTHONPATH:+:$PYTHONPATH}"
fi

missing=()
for mod in torch triton transformers simpy scipy numpy matplotlib pyarrow tqdm pytest servelab.simulator; do
    "$PY" -P -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [ $DRY -eq 0 ] && ! "$PY" -P -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    missing+=("a CUDA device (torch.cuda.is_available() is False; --dry-run runs without one)")
fi
[ -f .gpu/traces/azure-conv-2023-slice.csv ] || [[ " ${ARGS[*]-} " == *" --trace "* ]] \
    || missing+=(".gpu/traces/azure-conv-2023-slice.csv (run scripts/gpu_prepare.sh here first and carry .gpu, or give --trace SLICE: python scripts/gpu_check.py slice --help)")
if [ ${#missing[@]} -gt 0 ]; then
    echo "gpu_check: missing: $(IFS=';'; echo "${missing[*]}") (simpy: run scripts/gpu_prepare.sh and carry .gpu)" >&2
    exit 2
fi

mkdir -p "$WORK"
PACK=()
if [ -n "${OUT:-}" ] && [ "$(cd "$WORK" && pwd)" != "$(cd "$OUT" && pwd)" ]; then
    PACK=(--pack-into "$OUT")   # after every section, so a stopped call still brings results
fi
"$PY" scripts/gpu_check.py run --out "$WORK" "${PACK[@]}" "${ARGS[@]}" 2>&1 | tee "$WORK/console.log"
rc=${PIPESTATUS[0]}
if [ ${#PACK[@]} -gt 0 ]; then
    tar czf "$OUT/gpu-check.tgz" -C "$(dirname "$WORK")" "$(basename "$WORK")"
    cp "$WORK/manifest.json" "$WORK/console.log" "$OUT/" 2>/dev/null
    cp "$WORK/gpu-results.md" "$OUT/" 2>/dev/null
    echo "[gpu-check] packed $WORK into $OUT/gpu-check.tgz"
fi
exit $rc
