#!/usr/bin/env bash
# Refit the packaged calibration profiles (simulator/data/calibration/) from the public
# kernel measurements in ../shared/gpu-measurements (see its README). L40S has no
# element-wise measurements: it borrows the A100 fit for that family (same era, its
# efficiency is a fraction of each GPU's own bandwidth).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="${SERVELAB_MEASUREMENTS:-../shared/gpu-measurements}"
OUT=simulator/data/calibration
VERSION="aiconfigurator 095f58a51 (vLLM 0.14.0), vidur 7d47513"
SL="${SERVELAB:-.venv/bin/servelab}"
for gpu in a100-80gb h100-sxm; do
    "$SL" calibrate --from-measurements "$DATA" --gpu "$gpu" --drop-bad-rows --engine-version 0.14.0 \
        --data-version "$VERSION" --out "$OUT/$gpu.json"
done
"$SL" calibrate --from-measurements "$DATA" --gpu l40s --drop-bad-rows --engine-version 0.14.0 \
    --data-version "$VERSION" --fallback "$OUT/a100-80gb.json" --out "$OUT/l40s.json"
