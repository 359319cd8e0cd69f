#!/usr/bin/env python3
"""`kiln serve` throughput and latency: images per second and p50/p95/p99 latency for 1, 4 and 16 concurrent
clients, batching on (`--max-batch 4`) and off (`--max-batch 1`), and the server's overhead per request
against `kiln generate --calls N` in one process. Python's standard library only.

For each model and batching setting one server is started (loopback, ephemeral port, `--queue` large
enough that no request is refused, a warm-up call at the benchmark's size), then for each client count
every client sends --requests requests one after the other (OpenAI's `POST /v1/images/generations`,
`response_format` b64_json, its own seed per request); a request's latency is from sending it to having
the whole answer. images/s = images answered / wall time of that client count. Overhead per request:
the median 1-client latency minus the median end-to-end of `kiln generate --calls` (its `total_s`:
text encoding, steps and decoding; the server adds HTTP, the queue, PNG encoding and base64).

    python3 tools/bench_serve/bench.py --kiln target/release/kiln --model assets/tiny-flux
    python3 tools/bench_serve/bench.py --kiln target/release/kiln --model target/bench_flux_model \\
        --size 512 --steps 4 --requests 4

target/bench_flux_model is the scaled FLUX.1 that tools/bench_flux/bench.py builds.
"""
import argparse
import base64
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """`kiln serve` on a free loopback port, ready when /health answers; stopped with SIGTERM."""

    def __init__(self, args, max_batch: int):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        cmd = [args.kiln, "serve", "--model", args.model, "--port", str(self.port), "--dtype", args.dtype,
               "--compile", args.compile, "--queue", "64", "--max-batch", str(max_batch),
               "--warmup", f"{args.size}x{args.size}"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        deadline = time.monotonic() + args.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {self.proc.returncode}: {self.output()[-2000:]}")
            try:
                get(self.base + "/health", timeout=1.0)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"kiln serve did not answer /health within {args.start_timeout} s")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def peak_rss_mib(self) -> float:
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return float("nan")
        line = next(l for l in status.splitlines() if l.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def percentile(values, q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def load(server: Server, args, clients: int, model_name: str) -> dict:
    """`clients` threads, each sending args.requests requests in turn; latencies and images per second."""
    latencies, errors = [], []
    lock = threading.Lock()

    def client(index: int):
        for r in range(args.requests):
            body = {"model": model_name, "prompt": args.prompt, "n": 1, "size": f"{args.size}x{args.size}",
                    "response_format": "b64_json", "num_inference_steps": args.steps,
                    "seed": 1000 * index + r}
            t = time.perf_counter()
            try:
                out = post(server.base + "/v1/images/generations", body, timeout=args.request_timeout)
                png = base64.b64decode(out["data"][0]["b64_json"])
                if not png.startswith(b"\x89PNG"):
                    raise ValueError("the answer is not a PNG")
            except Exception as e:  # reported, not fatal: a benchmark shows its failures
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:300])
                continue
            with lock:
                latencies.append(time.perf_counter() - t)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "images": len(latencies), "wall_s": wall,
            "images_per_s": len(latencies) / wall if wall > 0 else float("nan"),
            "p50_s": percentile(latencies, 0.5), "p95_s": percentile(latencies, 0.95),
            "p99_s": percentile(latencies, 0.99), "errors": sorted(set(errors))}


def generate_baseline(args) -> dict:
    """`kiln generate --calls N` in one process: the median end to end of the calls after the first."""
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        timings = os.path.join(tmp, "timings.json")
        cmd = [args.kiln, "generate", "--model", args.model, "--prompt", args.prompt, "--height", str(args.size),
               "--width", str(args.size), "--steps", str(args.steps), "--dtype", args.dtype, "--compile", args.compile,
               "--calls", str(args.requests + 1), "--seed", "0", "--output", os.path.join(tmp, "out.png"),
               "--timings", timings]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        if out.returncode != 0:
            return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
        calls = json.loads(Path(timings).read_text())["calls"][1:]
        return {"e2e_s_median": statistics.median(c["total_s"] for c in calls), "calls": len(calls)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kiln", default=str(REPO / "target/release/kiln"))
    p.add_argument("--model", default=str(REPO / "assets/tiny-flux"))
    p.add_argument("--prompt", default="a red circle in the middle on a blue background")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dtype", default="f32")
    p.add_argument("--compile", default="auto")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests", type=int, default=8, help="requests per client")
    p.add_argument("--batches", default="4,1", help="--max-batch values (4: batching on, 1: off)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--warm", action="store_true",
                   help="run each client count once untimed first (a batch size the warm-up did not make compiles "
                        "its programs on its first batch; without --warm that shows in the latencies)")
    p.add_argument("--out", type=Path, help="write the results as JSON")
    args = p.parse_args()

    model_name = Path(args.model.rstrip("/")).name
    results = {"model": args.model, "size": args.size, "steps": args.steps, "dtype": args.dtype, "warm": args.warm,
               "compile": args.compile, "requests_per_client": args.requests, "runs": []}
    baseline = generate_baseline(args)
    results["generate"] = baseline
    print(f"kiln generate --calls {args.requests + 1}: {baseline}", file=sys.stderr)
    for max_batch in (int(b) for b in args.batches.split(",")):
        server = Server(args, max_batch)
        try:
            for clients in (int(c) for c in args.clients.split(",")):
                if args.warm:
                    # Untimed: the batch sizes this load forms compile their programs here, not in the timed run.
                    load(server, args, clients, model_name)
                r = load(server, args, clients, model_name)
                r["max_batch"] = max_batch
                results["runs"].append(r)
                print(f"max-batch {max_batch}, {clients:2} clients: {r['images_per_s']:.3f} images/s, "
                      f"p50 {r['p50_s']:.3f} s, p95 {r['p95_s']:.3f} s, p99 {r['p99_s']:.3f} s, {len(r['errors'])} error kinds",
                      file=sys.stderr)
            results.setdefault("server_peak_rss_mib", {})[max_batch] = server.peak_rss_mib()
        finally:
            server.stop()
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))

    print(f"\n### kiln serve, {model_name}, {args.size}x{args.size}, {args.steps} steps, {args.dtype}, "
          f"--compile {args.compile}, {args.requests} requests per client"
          f"{', after an untimed run of each client count' if args.warm else ''}\n")
    print("| batching | clients | images/s | p50 latency s | p95 latency s | errors |")
    print("|---|---|---|---|---|---|")
    for r in results["runs"]:
        batching = f"on (--max-batch {r['max_batch']})" if r["max_batch"] > 1 else "off (--max-batch 1)"
        print(f"| {batching} | {r['clients']} | {r['images_per_s']:.3f} | {r['p50_s']:.3f} | {r['p95_s']:.3f} | "
              f"{'; '.join(r['errors'])[:200] or 0} |")
    one = [r for r in results["runs"] if r["clients"] == 1 and r["max_batch"] == 1] or \
          [r for r in results["runs"] if r["clients"] == 1]
    if "e2e_s_median" in baseline and one:
        overhead = one[0]["p50_s"] - baseline["e2e_s_median"]
        print(f"\nserver overhead per request: 1-client p50 {one[0]['p50_s']:.4f} s - kiln generate's median call "
              f"{baseline['e2e_s_median']:.4f} s = {overhead:.4f} s")
    else:
        print(f"\nkiln generate baseline: {baseline.get('error', 'no 1-client run')}")


if __name__ == "__main__":
    main()
