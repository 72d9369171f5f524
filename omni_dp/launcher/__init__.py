"""A run: N replicas on one GPU behind one router, verified, supervised, torn down.

Where a run's files live is omni_dp/rundir.py (shared with the MPS package, which reads them).
Planning is pure (options.py + facts.py → plan.py); acting is thin and separate: state.py (the
run directory), processes.py (spawn and identity-checked signals), gates.py (health, KV, MPS),
replicas.py, bringup.py, supervisor.py, teardown.py, status.py; launch.py ties them together for
`omni-dp launch`. Never imports torch: replicas and the router are reached over HTTP.
"""
