"""omni-dp: same-GPU data parallelism for multi-stage omni model pipelines."""

__version__ = "0.1.0"
