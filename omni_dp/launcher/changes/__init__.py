"""Day-two changes to a live run without downtime: a rolling restart (the run's own plan, or new
engine arguments: a model update) and scaling to N replicas — planned as `launch` plans
(plan.py), asked of the run's supervisor (request.py), made by it step by step
(omni_dp/launcher/supervision/change_runner.py), and followed by the command that asked
(follow.py)."""
