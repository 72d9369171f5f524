"""A scripted stand-in for `nvidia-cuda-mps-control`'s front end, for tests only.

No GPU here means no MPS server can start, so server and client lists are scripted: the
scenario file named by $MPS_STANDIN_SCENARIO maps each command to a reply, e.g.
    {"get_server_list": "101", "get_client_list 101": "201\\n202"}
A missing command answers `Unknown command "…"` like the real one. Special keys:
    "unreachable": true   exit 1 with "Cannot find MPS control daemon process" on stderr
    "sleep": 5            answer after sleeping (to test timeouts)
Every command received is appended to the scenario's "log" file when one is named.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    scenario = json.loads(Path(os.environ["MPS_STANDIN_SCENARIO"]).read_text())
    command = sys.stdin.read().strip()
    if scenario.get("log"):
        with open(scenario["log"], "a") as log:
            log.write(command + "\n")
    if scenario.get("sleep"):
        time.sleep(scenario["sleep"])
    if scenario.get("unreachable"):
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    replies = scenario.get("replies", {})
    if command in replies:
        reply = replies[command]
        if reply:
            print(reply)
    else:
        print(f'Unknown command "{command}"')
    return 0


if __name__ == "__main__":
    sys.exit(main())
