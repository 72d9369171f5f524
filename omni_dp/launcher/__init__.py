"""A run: N replicas on one GPU behind one router, verified, supervised, torn down.

Where a run's files live is omni_dp/rundir.py (shared with the MPS package, which reads them).
Planning is pure (options.py + facts.py → plan.py); acting is thin and separate: state.py (the
run directory), processes.py (spawn and identity-checked signals), gates.py (health, KV, MPS),
replicas.py, bringup.py, teardown.py, status.py / listing.py / logview.py; supervisor.py owns
the supervision loop, supervision/ its parts; launch.py ties them together for `omni-dp launch`.
The run's records and their one reader are omni_dp/runfile.py. Never imports torch: replicas
and the router are reached over HTTP.
"""
