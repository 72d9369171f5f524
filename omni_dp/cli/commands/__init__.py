"""The commands of `omni-dp`, one module per group; omni_dp/cli/__init__.py lists them."""
