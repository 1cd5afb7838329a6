"""Held-out error of a packaged profile's fused-MoE fit per layer shape and batch band.

`servelab fidelity` reports bands of tokens x experts x EP; this splits the same held-out
rows by the layer's shape (hidden, inter, experts, top-k) instead, which is where the
remaining misses of docs/moe-mla.md ("Where it misses") are read from:

    python scripts/moe_shape_errors.py b200.vllm-0.24 [--family moe_fp8] [--measurements DIR]

Prints one line per (shape, tokens band): held-out rows, median signed error and MAPE (%).
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

from servelab.simulator.calibration import packaged
from servelab.simulator.gpus import get_gpu
from servelab.validation.kernel_fit import (DEFAULT_HOLDOUT, DEFAULT_SEED, FAMILIES, family_table,
                                            holdout_mask)
from servelab.validation.measurements import load_measurements

BANDS = ((32, "1-32"), (512, "33-512"), (4096, "513-4096"), (float("inf"), "> 4096"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", help="a packaged profile, e.g. b200.vllm-0.24")
    parser.add_argument("--family", default="moe", choices=("moe", "moe_fp8"))
    parser.add_argument("--measurements", default="../shared/gpu-measurements")
    args = parser.parse_args()
    prof = packaged(args.profile)
    ms = load_measurements([args.measurements], prof.device, drop_bad_rows=True,
                           engine_version=prof.engine_version)
    fam = FAMILIES[args.family]
    table = family_table(ms, fam)
    held = holdout_mask(table, float(prof.fit_stats.get("holdout_fraction", DEFAULT_HOLDOUT)),
                        int(prof.fit_stats.get("holdout_seed", DEFAULT_SEED)))
    err = fam.predict(table, get_gpu(ms.gpu), getattr(prof.kernels, args.family)) \
        / table["latency_s"] - 1.0
    groups: dict[tuple, list[float]] = defaultdict(list)
    for i in np.flatnonzero(held):
        shape = tuple(int(table[c][i]) for c in ("hidden", "inter", "experts", "topk"))
        band = next(label for edge, label in BANDS if table["tokens"][i] <= edge)
        groups[shape, band].append(float(err[i]))
    order = {label: k for k, (_, label) in enumerate(BANDS)}
    print(f"{args.profile} {args.family}: held-out rows by (hidden, inter, experts, top-k)")
    print("shape                        tokens     n  median %  MAPE %")
    for (shape, band), values in sorted(groups.items(), key=lambda kv: (kv[0][0], order[kv[0][1]])):
        v = np.array(values)
        print(f"{str(shape):28s} {band:9s} {len(v):4d}  {np.median(v) * 100:+7.1f}  "
              f"{np.mean(np.abs(v)) * 100:6.1f}")


if __name__ == "__main__":
    main()
