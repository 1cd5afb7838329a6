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
# Newer engines (profiles named <gpu>.vllm-<major.minor>, chosen by --engine): H100 keeps
# Vidur's element-wise fit, which its folder search finds; B200 carries that family from
# the H100 profile of the same engine, the RTX PRO 6000 (a PCIe card with GDDR memory, no
# element-wise tables) from L40S's. Neither measured an all-to-all: `calibrate` prices the
# PCIe RTX PRO 6000's EP exchange from its own ring all-reduce fit, not the fallback's
# all-to-all (kernels.movement.alltoall_from_ring); the NVLink B200 keeps the H100's
# measured exchange (the profile's source says which).
V24="aiconfigurator aiconfigurator-vllm-0.24.0 tables (vLLM 0.24.0)"
"$SL" calibrate --from-measurements "$DATA" --gpu h100-sxm --drop-bad-rows --engine-version 0.24.0 \
    --data-version "$V24, vidur 7d47513" --out "$OUT/h100-sxm.vllm-0.24.json"
"$SL" calibrate --from-measurements "$DATA/aiconfigurator-vllm-0.24.0" --gpu b200 --drop-bad-rows \
    --engine-version 0.24.0 --data-version "$V24" --fallback "$OUT/h100-sxm.vllm-0.24.json" \
    --out "$OUT/b200.vllm-0.24.json"
"$SL" calibrate --from-measurements "$DATA/aiconfigurator-vllm-0.19.0" --gpu rtx-pro-6000 \
    --drop-bad-rows --engine-version 0.19.0 \
    --data-version "aiconfigurator aiconfigurator-vllm-0.19.0 tables (vLLM 0.19.0)" \
    --fallback "$OUT/l40s.json" --out "$OUT/rtx-pro-6000.vllm-0.19.json"
