"""The attention op alone: torch's scaled_dot_product_attention against kiln's attention, one run.

Times torch's SDPA (CPU, --threads threads) on the scaled FLUX.1's attention shapes — [1, 8, 1152, 64] (512²),
[1, 8, 4224, 64] (1024²) and the VAE's [1, 1, 4096, 256] — in f32 and bf16, median of 9 calls after a warm-up, then
runs kiln's `op_times` bench (KILN_OP_TIMES=attention, the same shapes, inputs and medians) and prints both side by
side. Run from the repository root:

    /work/venv-bench/bin/python tools/bench_flux/sdpa.py
"""
import argparse
import re
import statistics
import subprocess
import time

import torch

SHAPES = [(1, 8, 1152, 64), (1, 8, 4224, 64), (1, 1, 4096, 256)]
RUNS = 9


def torch_ms(shape, dtype):
    n = 1
    for d in shape:
        n *= d
    # the same values as kiln's bench: ((i * 7919) % 1000) / 1000 - 0.5
    q = ((torch.arange(n, dtype=torch.float64) * 7919) % 1000 / 1000 - 0.5).to(dtype).reshape(shape)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa(q, q, q)
    times = []
    for _ in range(RUNS):
        t = time.perf_counter()
        sdpa(q, q, q)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def kiln_ms():
    out = subprocess.run(["cargo", "bench", "-q", "-p", "kiln-tensor", "--bench", "op_times"],
                         env={**__import__("os").environ, "KILN_OP_TIMES": "attention"},
                         capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        m = re.match(r"(\w+) attention \[(\d+), (\d+), (\d+), (\d+)\]: ([\d.]+)", line)
        if m:
            found[(m.group(1), tuple(int(m.group(i)) for i in range(2, 6)))] = float(m.group(6))
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    theirs = {(name, shape): torch_ms(shape, dt) for name, dt in [("f32", torch.float32), ("bf16", torch.bfloat16)]
              for shape in SHAPES}
    ours = kiln_ms()
    print(f"attention, median ms of {RUNS} ({args.threads} torch threads; kiln on XLA's pool)")
    print("| dtype | shape | torch SDPA ms | kiln ms | kiln / torch |")
    print("|---|---|---|---|---|")
    for (name, shape), t in theirs.items():
        k = ours.get((name, shape), float("nan"))
        print(f"| {name} | {list(shape)} | {t:.1f} | {k:.1f} | {k / t:.2f} |")


if __name__ == "__main__":
    main()
