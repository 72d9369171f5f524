"""The supervisor's parts, each with one reason to change (gunicorn's lesson: one owner of the
loop, simple pieces). The loop itself is supervisor.py.

    restart_policy   when to restart and when to give up (budget, window, backoff)
    slots            what can be restarted, what depends on what, which restarts are running
    crew             what the parts share: the run, the spawn gate, the probe of the world
    replica_watch    a replica's health counting, decided from what the sweep saw
    replica_restart  one replica through the gates of bring-up
    mps_watch        the daemon's health and the --on-mps-fault policy
    mps_restart      a new daemon and every replica that depends on it
    router_link      the router's admin calls, the replicas it did not take back, its restart
"""
