"""The SGLang model gateway (PyPI `sglang-router`, `smg`) as a fleet gateway for omni-dp.

Measured on sglang-router 0.3.2 (a Rust binary inside; its process is titled `sglang::router`):

- Worker API: `POST /workers {"url": U}` answers 202 `{"worker_id": UUID, ...}` at once and
  registers in a background job. `GET /workers` lists only registered workers (`id`, `url`,
  `is_healthy`, `model_id`, ...); `GET /workers/{id}` also answers for a pending job, with
  `job_status` {`status`: processing | failed, `message`}. `DELETE /workers/{id}` needs the
  UUID (a URL there: 400 "expected UUID"), answers 202 and the entry is gone from the list
  within ~10 ms; an unknown UUID: 404 WORKER_NOT_FOUND. The legacy /add_worker, /remove_worker
  and /list_workers are gone (404). With `--api-key K` or `--control-plane-api-keys` the
  worker API answers 401 without `Authorization: Bearer K`.
- Registration probes the worker: GET /health (must be 200), two HTTP/2 prior-knowledge
  connections (its gRPC detection: an aiohttp worker logs a 400 "Pause on PRI/Upgrade" for
  each), then GET /server_info (on 404: /get_server_info) and /model_info (on 404:
  /get_model_info). A new worker is listed already healthy, 0.05-0.3 s after the POST. A worker
  that never answers /health 200 stays `processing` (re-probed every few seconds) until the
  gateway's --worker-startup-timeout-secs (default 1800 s), then `failed`; the POST's own
  `max_connection_attempts` and `health_check_timeout_secs` do not shorten that. A DELETE
  while it is pending fails ("not found") and the job still adds the worker later, if it
  comes up.
- Duplicates: a POST of a URL already listed answers 202 with the existing entry's id, and the
  job fails "Worker U already exists"; the entry stays, one of it. No 409 was seen.
- URLs are stored as given, compared as strings: `http://h:p/` probes `//health` (404) and
  hangs in `processing`; `HTTP://...` never registers; `h:p` without a scheme registers over an
  existing `http://h:p`, its model forgotten; `localhost` and `127.0.0.1` are two workers.
  Hence normalize_url: lower-case scheme and host, `http://` when none, no trailing slash.
- No disable: `PUT /workers/{id}` (202, applied in the background) changes priority, cost,
  labels and `disable_health_check` (which only stops its health checks); any other field,
  `disabled` among them, gets a 202 too and is ignored. So a restarting replica is
  deregistered and registered again once it passed its gates.
- Model hub: when /server_info or /model_info names a `model_path` or `tokenizer_path` that is
  not an existing local directory, registration tries to download a tokenizer from Hugging
  Face (and only logs the failure); an existing directory is read locally; neither field: the
  tokenizer step is skipped. omni-dp's /get_server_info names neither, and the test stand-ins
  answer `served_model_name` only (the gateway's model_id then). None of `smg launch`'s flags
  turns that step off (--model-path/--tokenizer-path are about loading one).
- Routing: /v1/completions, /v1/chat/completions and /generate are proxied (a /v1 body without
  `model` is a 422; without --enable-igw any model is accepted); /v1/audio/speech is not: the
  gateway answers 404 itself. /readiness is 503 "insufficient healthy workers" until one is
  healthy. Prometheus listens on a second port, 29000 unless --prometheus-port; it cannot be
  turned off.
"""

from __future__ import annotations

import time
import urllib.parse
from dataclasses import replace

from omni_dp.blocking_http import Answer, call
from omni_dp.gateway.base import GatewayError, GatewayWorker

_POLL_FIRST_S = 0.05  # registration takes ~0.05-0.3 s: look soon, then less often
_POLL_MAX_S = 0.5


def normalize_url(url: str) -> str:
    """A worker or gateway URL the way the gateway must be given it and compares it:
    `http://host:port[/path]`, scheme and host lower-case, no trailing slash."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urllib.parse.urlsplit(text)
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not an http(s) URL: {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"a URL with a query or fragment: {url!r}")
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{parts.path.rstrip('/')}"


class SglangGateway:
    """The worker API of one SGLang model gateway (0.3.x), by blocking HTTP calls.

    `timeout_s` bounds each call; `api_key` is sent as `Authorization: Bearer` (the gateway's
    --api-key, or an admin key of its --control-plane-api-keys)."""

    can_disable = False  # 0.3.2 has no disable switch (see the module's docstring)

    def __init__(self, url: str, *, timeout_s: float = 10.0, api_key: str | None = None) -> None:
        try:
            self.url = normalize_url(url)
        except ValueError as exc:
            raise GatewayError(f"--register: {exc}") from None
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def describe(self) -> str:
        return f"the SGLang model gateway at {self.url}"

    # --- the worker API ----------------------------------------------------------------------
    def workers(self) -> list[GatewayWorker]:
        answer = self._call("GET", "/workers")
        if answer.status != 200:
            raise self._refused("GET /workers", answer)
        listed = answer.body.get("workers") if isinstance(answer.body, dict) else None
        if not isinstance(listed, list):
            raise GatewayError(f"GET {self.url}/workers did not answer a worker list "
                               f"({answer.words()}): is this an SGLang model gateway 0.3?")
        return [self._worker(entry) for entry in listed if isinstance(entry, dict)]

    def find(self, worker_url: str) -> GatewayWorker | None:
        """The listed entry for worker_url (compared normalized), or None."""
        url = normalize_url(worker_url)
        return next((w for w in self.workers() if _same(w.url, url)), None)

    def register(self, worker_url: str, *, wait_s: float) -> GatewayWorker:
        """Add worker_url and wait up to wait_s until the gateway lists it healthy.

        Already listed and healthy: that entry, `already_registered` set, nothing posted.
        Listed but unhealthy (a leftover whose replica died): removed and registered afresh,
        because the gateway would take its health checks' success threshold times their
        interval to believe in it again; `replaced_id` names the removed entry."""
        url = self._worker_url(worker_url)
        deadline = time.monotonic() + wait_s
        existing = self.find(url)
        replaced_id = None
        if existing is not None:
            if existing.healthy:
                return replace(existing, already_registered=True)
            self._remove(existing)
            replaced_id = existing.worker_id
        answer = self._call("POST", "/workers", {"url": url})
        if answer.status == 409:  # not seen on 0.3.2 (a duplicate is a 202 there); documented
            job_id = None
        elif answer.status in (200, 201, 202):
            body = answer.body if isinstance(answer.body, dict) else {}
            job_id = str(body.get("worker_id") or body.get("id") or "") or None
        else:
            raise self._refused(f"POST /workers for {url}", answer)
        worker, status = self._wait_registered(url, job_id, deadline)
        if worker is not None:
            duplicate = answer.status == 409 or "already exists" in (status or "")
            return replace(worker, already_registered=duplicate or replaced_id is not None,
                           replaced_id=replaced_id)
        job = f"its job {job_id}" if job_id else "its registration"
        raise GatewayError(
            f"{self.describe()} did not list {url} as a healthy worker within {wait_s:g} s: "
            f"{job} is {status or 'not to be seen'}. The gateway keeps probing {url}/health on "
            f"its own (until its --worker-startup-timeout-secs) and may still add it later; is "
            f"{url} reachable from the gateway's host?")

    def deregister(self, worker_url: str) -> bool:
        """Remove worker_url and check the gateway no longer lists it: True; False when it was
        not listed (nothing to do). A registration still pending is not listed, so it is not
        removed: the gateway refuses to delete it until it completes."""
        url = self._worker_url(worker_url)
        removed = [self._remove(w) for w in self.workers() if _same(w.url, url)]
        return any(removed)

    # --- inside ------------------------------------------------------------------------------
    def _wait_registered(self, url: str, job_id: str | None,
                         deadline: float) -> tuple[GatewayWorker | None, str | None]:
        """(the healthy listed entry or None, the last job status seen, with its message)."""
        status: str | None = None
        pause = _POLL_FIRST_S
        while True:
            listed = self.find(url)
            if listed is not None and listed.healthy:
                return listed, status
            if listed is not None:
                status = f"listed but not healthy (is_healthy={listed.healthy})"
            elif job_id is not None:
                status = self._job_status(job_id, url) or status
            if time.monotonic() >= deadline:
                return None, status
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, _POLL_MAX_S)

    def _job_status(self, job_id: str, url: str) -> str | None:
        """The pending job's status in words; GatewayError when the gateway gave up on it (but
        not for "already exists": someone else registered the URL meanwhile, which is fine)."""
        answer = self._call("GET", f"/workers/{urllib.parse.quote(job_id, safe='')}")
        job = answer.body.get("job_status") if isinstance(answer.body, dict) else None
        if answer.status != 200 or not isinstance(job, dict):
            return None
        said = f"{job.get('status')}" + (f" ({job['message']})" if job.get("message") else "")
        if job.get("status") == "failed" and "already exists" not in said:
            raise GatewayError(f"{self.describe()} could not register {url}: job {job_id} "
                               f"failed: {job.get('message') or 'no reason given'}")
        return said

    def _remove(self, worker: GatewayWorker) -> bool:
        """DELETE one entry by its id and wait until it is no longer listed: True; False when
        the gateway no longer knew it (404)."""
        path = f"/workers/{urllib.parse.quote(worker.worker_id, safe='')}"
        answer = self._call("DELETE", path)
        if answer.status == 404:
            return False
        if answer.status not in (200, 202, 204):
            raise self._refused(f"DELETE {path} ({worker.url})", answer)
        deadline = time.monotonic() + self.timeout_s
        pause = _POLL_FIRST_S / 5  # removal takes ~10 ms
        while any(w.worker_id == worker.worker_id for w in self.workers()):
            if time.monotonic() >= deadline:
                job = self._call("GET", path).body
                status = job.get("job_status") if isinstance(job, dict) else None
                raise GatewayError(f"{self.describe()} accepted the removal of {worker.url} "
                                   f"but still lists it after {self.timeout_s:g} s "
                                   f"(job: {status or 'not to be seen'})")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
        return True

    def _worker_url(self, worker_url: str) -> str:
        try:
            return normalize_url(worker_url)
        except ValueError as exc:
            raise GatewayError(f"cannot register with {self.describe()}: {exc}") from None

    def _call(self, method: str, path: str, body: object = None) -> Answer:
        answer = call(method, self.url + path, body, timeout=self.timeout_s,
                            headers=self._headers)
        if answer.status == 0:
            raise GatewayError(f"no answer from {self.describe()} ({method} {path}: "
                               f"{answer.error}): is it running, and is the URL right?")
        return answer

    def _refused(self, what: str, answer: Answer) -> GatewayError:
        hint = ""
        if answer.status in (401, 403):
            hint = (" - pass the gateway's API key (its --api-key, or an admin key of its "
                    "--control-plane-api-keys)")
        elif answer.status == 404 and what.startswith("GET /workers"):
            hint = " - is this an SGLang model gateway 0.3 (older ones have /list_workers)?"
        return GatewayError(f"{self.describe()} refused {what}: {answer.status} "
                            f"{answer.words()}{hint}")

    @staticmethod
    def _worker(entry: dict) -> GatewayWorker:
        healthy = entry.get("is_healthy")
        model = entry.get("model_id")
        return GatewayWorker(url=str(entry.get("url", "")), worker_id=str(entry.get("id", "")),
                             healthy=healthy if isinstance(healthy, bool) else None,
                             disabled=None, model_id=str(model) if model is not None else None,
                             raw=entry)


def _same(listed: str, url: str) -> bool:
    """Whether a listed URL is `url` (normalized), an unparsable listed one never."""
    try:
        return normalize_url(listed) == url
    except ValueError:
        return False
