"""Where a replica's pipeline stages run: which process, which device, what memory budget.

Torch-free, so that the launcher and the engine read one placement: `model` holds the types,
`config` reads defaults → a YAML file → dotted CLI overrides, `validate` resolves and checks
them (every problem at once), `table` shows the result, `builtin` declares omni-dp's pipeline.
"""
