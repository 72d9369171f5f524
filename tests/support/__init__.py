"""What the tests share: importable as `support` from every test (pyproject.toml's pytest
`pythonpath` puts tests/ on sys.path). Shared fixtures live in the conftest.py of the directory
whose tests use them (tests/conftest.py for those of several); the modules here hold plain
helpers, and no test imports a conftest or another test module.

    http_client  the one HTTP client: blocking (request, get, post_json, speech), in a loop
                 (client, fetch)
    ports        free loopback ports (one, several, a consecutive block) and port probes
    wait         waiting until something holds: wait_for (blocking), until (async)
    replica      an `omni-dp serve` subprocess (the root conftest's replica fixtures)
    launcher     a run of `omni-dp launch` (Run, MpsRun) and the process look-ups around it
    plans        hand-built machines, launch plans and run records
    router       aiohttp stand-in replicas and an in-process router
    mps          the scripted MPS front end (Standin) and the real control binary's lookup
    mps_standin  the scripted front end itself, run as a program by path
    mps_hybrid   the hybrid front end (real daemon, faked attachment), run as a program by path
    nvml         a fake pynvml
    talker       the small talker the model tests share
    tp_rank      a tensor-parallel rank as a process of its own (the TP tests' rank 1)
    virtual_clock  an asyncio loop whose clock jumps to its next timer (exact loop times)
"""
