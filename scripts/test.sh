#!/usr/bin/env bash
# Set up .venv (every extra) and run the whole test suite. The Triton-interpreter kernel
# tests run in their own pytest process, so a crash there cannot take the rest down; the
# CUDA compile check runs in a third with the interpreter off (it cannot compile under it).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
servelab_setup "backend,test"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MPLBACKEND=Agg TRITON_INTERPRET=1
export SERVELAB_SHARED="${SERVELAB_SHARED:-$ROOT/../shared}"
PY="$VENV/bin/python"
status=0
"$PY" -m pytest -q -m "not kernels and not cuda_compile" "$@" || status=$?
"$PY" -m pytest -q -m kernels "$@" || { rc=$?; [ $rc -eq 5 ] || status=$rc; }
TRITON_INTERPRET=0 "$PY" -m pytest -q -m cuda_compile "$@" || { rc=$?; [ $rc -eq 5 ] || status=$rc; }
exit $status
