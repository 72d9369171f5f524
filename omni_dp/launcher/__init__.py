"""A run: N replicas on one GPU behind one router, verified, supervised, torn down.

Where a run's files live is omni_dp/rundir.py (shared with the MPS package, which reads them).
The rooms (docs/design.md has the map): engines/ (one adapter per engine); planning/, pure
(planning/options.py + planning/facts.py → planning/plan.py); acting is thin and separate:
record/ (the run directory, record/state.py), processes/ (spawn and identity-checked signals),
bringup/ (bringup/replicas.py, the gates of bringup/gates.py: health, KV, MPS), teardown.py,
changes/ (day-two restart and scale), supervision/ (supervision/supervisor.py owns the loop,
the other modules are its parts) and views/ (views/status.py, views/listing.py,
views/logview.py, views/top.py); launch.py ties them together for `omni-dp launch`. The run's
records and their one reader are omni_dp/runfile.py. Never imports torch: replicas and the
router are reached over HTTP.
"""
