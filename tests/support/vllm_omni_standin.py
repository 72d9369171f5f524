"""A STAND-IN for vllm-omni's `python -m vllm_omni.entrypoints.cli.main serve MODEL --omni`
(`install_shim` writes that module name, in a test's directory, to run this one),
for the parts of the adapter that need a running replica and no CUDA: one API process that
starts one child process per stage of the deploy file, each logging vLLM's per-stage KV line
(`GPU KV cache size: N tokens`, vLLM 0.30's text) to the replica's stdout, and that serves
/health and /v1/audio/speech on loopback. It is not vllm-omni: it reads only what the adapter
writes (the model, --omni, --host, --port, --deploy-config, --stage-overrides) and refuses a
command line without them, the way vllm-omni would be unusable without them.

A stage pinned by `kv_cache_memory_bytes` logs bytes // STANDIN_KV_BYTES_PER_TOKEN tokens; an
unpinned stage logs UNPINNED_TOKENS. Every child exits when its parent does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

SHIM = "from vllm_omni_standin import main\nraise SystemExit(main())\n"

UNPINNED_TOKENS = 2048
STAGE = r"""
import os, sys, time
print(f"(stage-{sys.argv[1]} pid={os.getpid()}) INFO [kv_cache_utils.py:2396] GPU KV cache "
      f"size: {int(sys.argv[2]):,} tokens, Maximum concurrency for 4,096 tokens per request: "
      "1.00x", flush=True)
parent = os.getppid()
while os.getppid() == parent:
    time.sleep(0.2)
"""


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self._answer(200 if self.path == "/health" else 404, b"")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        if self.path == "/v1/audio/speech":
            self._answer(200, b"RIFF" + bytes(40), "audio/wav")
        else:
            self._answer(404, b'{"detail": "Not Found"}', "application/json")

    def _answer(self, status: int, body: bytes, kind: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def install_shim(root: Path) -> Path:
    """`vllm_omni/entrypoints/cli/main.py` under root, running this stand-in: root and this
    folder on PYTHONPATH make the adapter's `-m vllm_omni.entrypoints.cli.main` start it."""
    cli = root / "vllm_omni" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for folder in (cli, cli.parent, cli.parent.parent):
        (folder / "__init__.py").write_text("")
    (cli / "main.py").write_text(SHIM)
    return root


def main() -> int:
    if sys.argv[1:2] != ["serve"] or "--omni" not in sys.argv:
        print("stand-in: expected `serve MODEL --omni ...`", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="vllm-omni stand-in")
    parser.add_argument("command")
    parser.add_argument("model")
    parser.add_argument("--omni", action="store_true", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--deploy-config", required=True)
    parser.add_argument("--stage-overrides", type=json.loads, default={})
    args = parser.parse_args()
    with open(args.deploy_config, encoding="utf-8") as f:
        stages = [s["stage_id"] for s in yaml.safe_load(f)["stages"]]
    per_token = int(os.environ.get("STANDIN_KV_BYTES_PER_TOKEN", "8192"))
    children = []
    for stage in stages:
        pinned = args.stage_overrides.get(str(stage), {}).get("kv_cache_memory_bytes")
        tokens = pinned // per_token if pinned is not None else UNPINNED_TOKENS
        children.append(subprocess.Popen([sys.executable, "-c", STAGE, str(stage),
                                          str(tokens)]))
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    try:
        server.serve_forever()
    finally:
        for child in children:
            child.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
