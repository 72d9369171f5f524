"""The launcher (issue 5). Built so far: CPU topology and per-replica CPU blocks."""
