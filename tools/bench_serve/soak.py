#!/usr/bin/env python3
"""A timed soak of `kiln serve`: N clients for T seconds mixing good requests (OpenAI route), jobs that are
submitted and cancelled, clients that disconnect mid-request, and malformed bodies; the server's resident
memory sampled every --every seconds. Afterwards every accepted job must be in a terminal state and the
only 5xx answers the documented 503s. Python's standard library only.

    python3 tools/bench_serve/soak.py --kiln target/release/kiln --model assets/tiny-flux --seconds 600

Prints one JSON object: requests by kind and status, RSS (MiB) after warm-up, at the end and its maximum,
the samples, and the checks.
"""
import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(method, url, body=None, timeout=60.0):
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", default="target/release/kiln")
    ap.add_argument("--model", default="assets/tiny-flux")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--warmup-seconds", type=float, default=60)
    ap.add_argument("--every", type=float, default=15)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()
    store = tempfile.mkdtemp()
    # Jobs are kept (in the store) past the run, so that every accepted one can be checked at the end.
    proc = subprocess.Popen([args.kiln, "serve", "--model", args.model, "--port", str(port), "--queue", "64",
                             "--max-batch", "4", "--warmup", f"{args.size}x{args.size}",
                             "--keep-images", str(int(args.seconds) + 3600), "--jobs-db", f"{store}/jobs.sqlite"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    deadline = time.monotonic() + 300
    while True:
        try:
            if request("GET", base + "/health", timeout=1)[0] == 200:
                break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            sys.exit(f"kiln serve did not start: {log.read().decode(errors='replace')[-2000:]}")
        time.sleep(0.5)

    counts, jobs, lock = {}, [], threading.Lock()
    stop_at = time.monotonic() + args.seconds

    def count(kind, status):
        with lock:
            counts.setdefault(kind, {}).setdefault(str(status), 0)
            counts[kind][str(status)] += 1

    good = {"prompt": "a lighthouse at dawn", "size": f"{args.size}x{args.size}", "response_format": "b64_json",
            "num_inference_steps": args.steps}

    def client(seed):
        rng = random.Random(seed)
        while time.monotonic() < stop_at:
            r = rng.random()
            try:
                if r < 0.7:
                    count("good", request("POST", base + "/v1/images/generations", {**good, "seed": rng.randrange(1 << 30)})[0])
                elif r < 0.8:
                    status, body = request("POST", base + "/kiln/v1/jobs", {"prompt": "a fox", "width": args.size,
                                                                          "height": args.size, "num_inference_steps": args.steps})
                    count("job", status)
                    if status == 202:
                        job = json.loads(body)["id"]
                        with lock:
                            jobs.append(job)
                        if rng.random() < 0.5:
                            count("cancel", request("DELETE", f"{base}/kiln/v1/jobs/{job}")[0])
                elif r < 0.9:
                    # A client that sends half a body and vanishes.
                    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                        body = json.dumps(good).encode()
                        s.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[: len(body) // 2])
                    count("disconnect", "closed")
                else:
                    bad = rng.choice([b"{", b"[" * 100 + b"]" * 100, b'{"prompt": 5}', b'{"size": "9x9x9", "prompt": "a"}'])
                    count("malformed", request("POST", base + "/v1/images/generations", bad)[0])
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                count("client_error", type(e).__name__)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    start = time.monotonic()
    for t in threads:
        t.start()
    samples = []
    while any(t.is_alive() for t in threads):
        samples.append((round(time.monotonic() - start, 1), round(rss_mib(proc.pid), 1)))
        time.sleep(args.every)
    for t in threads:
        t.join()
    # Every accepted job ends: done, failed or cancelled.
    terminal, pending = 0, []
    end = time.monotonic() + 120
    for job in jobs:
        while True:
            status, body = request("GET", f"{base}/kiln/v1/jobs/{job}")
            state = json.loads(body).get("status") if status == 200 else f"http {status}"
            if state in ("succeeded", "done", "failed", "cancelled", "canceled") or time.monotonic() > end:
                break
            time.sleep(0.2)
        if state in ("succeeded", "done", "failed", "cancelled", "canceled"):
            terminal += 1
        else:
            pending.append((job, state))
    samples.append((round(time.monotonic() - start, 1), round(rss_mib(proc.pid), 1)))
    proc.terminate()
    proc.wait(timeout=60)
    after_warmup = [m for t, m in samples if t >= args.warmup_seconds]
    five_xx = {k: s for k, v in counts.items() for s in v if s.startswith("5") and s != "503"}
    print(json.dumps({
        "clients": args.clients, "seconds": args.seconds, "counts": counts,
        "jobs_accepted": len(jobs), "jobs_terminal": terminal, "jobs_pending": pending[:5],
        "rss_mib_after_warmup": after_warmup[0] if after_warmup else None,
        "rss_mib_end": samples[-1][1], "rss_mib_max": max(m for _, m in samples),
        "unexpected_5xx": five_xx, "server_exit": proc.returncode, "samples": samples,
    }, indent=1))


if __name__ == "__main__":
    main()
