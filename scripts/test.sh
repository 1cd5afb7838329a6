#!/usr/bin/env bash
# Set up .venv (every extra) and run the whole test suite. The Triton-interpreter kernel
# tests run in their own pytest process, so a crash there cannot take the rest down; the
# CUDA compile check runs in a third with the interpreter off (it cannot compile under it),
# started first and alongside the others: it is mostly ptxas in worker processes, and the
# rest is single-threaded Python, so on two cores they overlap.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
servelab_setup "backend,test"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MPLBACKEND=Agg TRITON_INTERPRET=1
export SERVELAB_SHARED="${SERVELAB_SHARED:-$ROOT/../shared}"
PY="$VENV/bin/python"
status=0
compile_log="$(mktemp)"
TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider -m cuda_compile "$@" >"$compile_log" 2>&1 &
compile_pid=$!
"$PY" -m pytest -q -m "not kernels and not cuda_compile" "$@" || status=$?
"$PY" -m pytest -q -m kernels "$@" || { rc=$?; [ $rc -eq 5 ] || status=$rc; }
wait "$compile_pid" || { rc=$?; [ $rc -eq 5 ] || status=$rc; }
echo "--- CUDA compile check (ran alongside) ---"
cat "$compile_log"
rm -f "$compile_log"
exit $status
