"""The router tests take no fixtures: each one runs its backends, router and client inside one
bounded `asyncio.run` (support/router.py's `run`), so whatever it starts is stopped by the
context managers of support/router.py before the test returns."""
