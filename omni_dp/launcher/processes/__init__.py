"""What a run starts, and only that: spawning, recognising its own processes (pid and create time,
or the run token), signalling and stopping them; the CPU-pinning exec wrapper.
"""
