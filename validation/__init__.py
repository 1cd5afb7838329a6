"""Simulator against measurement: sim-vs-real comparison of runs, calibration fitting from
real runs (and from measured GPU tables), the CPU probe and trace replay."""
