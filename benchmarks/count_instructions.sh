#!/usr/bin/env bash
# Instructions executed by one command, counted by valgrind (callgrind): a deterministic
# stand-in for wall time on a machine whose speed drifts (this project's 2-core machine
# varies by up to 1.5x within minutes, so a 10% change cannot be seen in wall seconds).
#
#   bash benchmarks/count_instructions.sh PYTHON -m servelab simulate --trace T ... --out DIR
#
# prints "<millions> M instructions". Run two versions of the code side by side (two
# checkouts, two virtual environments) and compare. The count is repeatable to ~0.01%
# with the settings below: OpenBLAS's idle worker threads (numpy) otherwise add a
# varying number of spin-loop instructions, and string hashing is randomised per process.
# Expect ~50x the native run time. Needs valgrind (Debian: apt-get install valgrind).
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 PYTHON ARGS... (the command to count)" >&2
    exit 2
fi
command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 2; }
out=$(OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 PYTHONHASHSEED=0 \
      valgrind --tool=callgrind --callgrind-out-file=/dev/null "$@" 2>&1 >/dev/null)
echo "$out" | awk '/Collected/ {printf "%.0f M instructions\n", $4 / 1e6; found = 1}
                   END {if (!found) exit 1}' || { echo "$out" >&2; exit 1; }
