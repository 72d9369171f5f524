"""The run's record on disk: run.json (written atomically at every step), events.jsonl, the logs
directory.
"""
