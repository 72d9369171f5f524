"""`omni-dp bench` and `omni-dp plan`: how many replicas fit a model on a GPU (plan, pure
arithmetic over a probed footprint), and whether they pay (bench: a concurrency sweep per
configuration, ranges over trials, every failure counted, a table, JSON and a figure)."""
