"""Calls to a pdkv server's HTTP API (an engine's, or the proxy's), as a
trainer makes them around a weight sync: ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/pause``, ``/finish_weight_update``, ...
"""

import json
import subprocess
import urllib.error
import urllib.request


def call(url, path, body=None, method="POST", token=None, timeout=120):
    """``(status, JSON answer)`` of one request to ``url + path`` (a JSON
    ``body`` when given; the admin ``token`` as a bearer token). An HTTP
    error is an answer like any other; no answer within ``timeout`` seconds
    raises."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stop(process, timeout=30):
    """Stops an engine process this program started (``pdkv serve`` or
    ``pdkv up``): SIGTERM, then SIGKILL if it has not exited within
    ``timeout`` seconds. True when it stopped on the SIGTERM."""
    process.terminate()
    try:
        process.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout)
        return False
