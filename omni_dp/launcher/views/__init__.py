"""What a run looks like from outside: `status`, `list`, `logs`, the Prometheus scrape targets.
Reads the record and asks the live processes; starts nothing.
"""
