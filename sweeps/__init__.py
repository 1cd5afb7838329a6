"""Sweep orchestration: grids of simulation points, the resumable point store, local
process-pool or Ray execution, and the `compare` command that drives them."""
