"""Step caches, kiln vs kiln uncached vs diffusers with the same cache, side by side in one run.

For each dtype (--dtypes) and each --cache (kiln's `KIND:FIELD=VALUE,...`, diffusers' config field names), one
process per engine makes one image of --steps steps (default 28) at --size² (seed 0): kiln `generate --compile
full --cache ...` on a program cache filled beforehand by a short warm-up process with the same cache kind (so the
timed call compiles nothing), diffusers eager with the same config (`pipe.transformer.enable_cache(config)`, or
`apply_mag_cache` where the transformer has no `enable_cache`: SD3). The uncached run of each engine is the baseline.
Combinations diffusers 0.42.1 cannot run (README-cache.md of the oracle: SD3 takes only MagCache) are kiln-only.

Per process: end to end (text encoding + steps + decode, kiln's own timings and diffusers' call), median step,
transformer calls served from the cache (kiln prints them; for diffusers, the calls in which the last block's
attention projection did not run), the mean |difference| to the same engine's uncached image and to the other
engine's image with the same cache (0-255 levels), and foreign_cpu_s (machine-wide busy CPU seconds during the
process minus the process's own: ~0 means nothing else ran).

    VENV/bin/python tools/bench_flux/step_cache.py --pipeline flux_wide --kiln target/release/kiln \
        --cache first-block:threshold=0.3 --cache taylorseer --cache magcache:threshold=0.12 --out cache.json
"""
import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the model builders and folders)

FLUX_MAG_RATIOS = None  # filled from diffusers in the diffusers process


def parse_cache(spec: str):
    """`KIND[:FIELD=VALUE,...]` -> (kind, {field: value}); lists with `;`, as kiln parses it."""
    kind, _, fields = spec.partition(":")

    def item(v: str):
        v = v.strip()
        if v in ("True", "true", "False", "false"):
            return v.lower() == "true"
        if v in ("None", "none"):
            return None
        try:
            return int(v)
        except ValueError:
            try:
                return float(v)
            except ValueError:
                return v

    out = {}
    for field in filter(None, (f.strip() for f in fields.split(","))):
        name, _, value = field.partition("=")
        out[name.strip()] = [item(v) for v in value.split(";")] if ";" in value else item(value)
    return kind.strip(), out


def diffusers_config(pipe, kind: str, fields: dict, steps: int):
    import diffusers
    from diffusers.hooks import mag_cache

    fields = dict(fields)
    if kind == "first-block":
        return diffusers.FirstBlockCacheConfig(**fields)
    if kind == "taylorseer":
        return diffusers.TaylorSeerCacheConfig(**fields)
    if kind == "magcache":
        fields.setdefault("num_inference_steps", steps)
        fields.setdefault("mag_ratios", mag_cache.FLUX_MAG_RATIOS)
        return diffusers.MagCacheConfig(**fields)
    if kind == "faster":
        for key in ("spatial_attention_timestep_skip_range",):
            if key in fields:
                fields[key] = tuple(fields[key])
        fields.setdefault("tensor_format", "BCHW")
        return diffusers.FasterCacheConfig(current_timestep_callback=lambda: pipe.current_timestep, **fields)
    raise SystemExit(f"unknown cache kind {kind}")


def run_diffusers(args) -> dict:
    import diffusers
    import torch

    torch.set_num_threads(args.threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    spec = bench.PIPELINES[args.pipeline]
    pipe = getattr(diffusers, spec.class_name).from_pretrained(args.model, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    if args.cache:
        kind, fields = parse_cache(args.cache[-1])
        config = diffusers_config(pipe, kind, fields, args.steps)
        if hasattr(pipe.transformer, "enable_cache"):
            pipe.transformer.enable_cache(config)
        elif kind == "magcache":
            from diffusers.hooks import apply_mag_cache
            apply_mag_cache(pipe.transformer, config)
        else:
            raise SystemExit(f"{spec.class_name}: diffusers has no {kind} here")
    # A transformer call computed its blocks iff the last block's attention projection ran.
    blocks = [m for name in ("single_transformer_blocks", "transformer_blocks")
              if (m := getattr(pipe.transformer, name, None)) is not None and len(m)]
    probe = blocks[0][-1].attn.to_q
    computed = [0]
    probe.register_forward_hook(lambda *_: computed.__setitem__(0, computed[0] + 1))
    calls = [0]
    pipe.transformer.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    marks = []
    kwargs = dict(prompt=args.prompt, height=args.size, width=args.size, num_inference_steps=args.steps,
                  guidance_scale=args.guidance, max_sequence_length=args.max_sequence_length,
                  generator=torch.Generator("cpu").manual_seed(0),
                  callback_on_step_end=lambda p, i, t, kw: (marks.append(time.perf_counter()), kw)[1])
    with torch.inference_mode():
        t0 = time.perf_counter()
        image = pipe(**kwargs).images[0]
        e2e = time.perf_counter() - t0
    image.save(args.image)
    steps = [b - a for a, b in zip(marks, marks[1:])]
    return {"e2e_s": e2e, "step_s_median": statistics.median(steps) if steps else float("nan"),
            "served": calls[0] - computed[0], "calls": calls[0],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")


def timed(cmd, env=None):
    """Run `cmd`; (completed process, wall s, foreign CPU s, the largest child's peak RSS MiB so far)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    b0, t0 = busy_s(), time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall, b1 = time.perf_counter() - t0, busy_s()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return out, wall, b1 - b0 - own, after.ru_maxrss / 1024


def warmup_spec(spec: str) -> str:
    """The same cache kind with settings that take both paths (computed and served) in 4 steps, so the
    warm-up compiles every program the timed run uses."""
    kind, _ = parse_cache(spec)
    return {
        "first-block": "first-block:threshold=1000",
        "taylorseer": "taylorseer:cache_interval=2,disable_cache_before_step=1",
        "magcache": "magcache:threshold=1000,max_skip_steps=1,num_inference_steps=4",
        "faster": "faster:spatial_attention_block_skip_range=2,spatial_attention_timestep_skip_range=-1;999.9,"
                  "is_guidance_distilled=True",
    }.get(kind, spec)


def run_kiln(args, dtype: str, spec: str, program_cache: str, image: str) -> dict:
    common = [args.kiln, "generate", "--model", str(args.model), "--prompt", args.prompt, "--height", str(args.size),
              "--width", str(args.size), "--guidance-scale", str(args.guidance), "--max-sequence-length",
              str(args.max_sequence_length), "--dtype", dtype, "--device", "cpu", "--compile", "full", "--seed", "0"]
    env = {"KILN_CACHE_DIR": program_cache, "TF_CPP_MIN_LOG_LEVEL": "2"}
    with tempfile.TemporaryDirectory() as tmp:
        warm = [*common, "--num-inference-steps", "4", "--output", f"{tmp}/w.png"]
        if spec:
            warm += ["--cache", warmup_spec(spec)]
        w, _, _, _ = timed(warm, env)
        if w.returncode:
            return {"error": "warm-up: " + (w.stderr.strip().splitlines() or ["?"])[-1]}
        cmd = [*common, "--num-inference-steps", str(args.steps), "--output", image, "--timings", f"{tmp}/t.json"]
        if spec:
            cmd += ["--cache", spec]
        out, wall, foreign, _ = timed(cmd, env)
        if out.returncode:
            return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
        t = json.loads(Path(f"{tmp}/t.json").read_text())
    call = t["calls"][-1] if "calls" in t else t
    steps = call["steps_s"]
    served = re.search(r"step cache: (\d+) of (\d+) transformer calls", out.stderr)
    return {"e2e_s": call["total_s"], "step_s_median": statistics.median(steps), "process_s": wall,
            "foreign_cpu_s": foreign, "served": int(served[1]) if served else 0,
            "calls": int(served[2]) if served else len(steps), "programs_compiled": call.get("programs_compiled")}


def mean_diff(a: str, b: str) -> float:
    import numpy as np
    from PIL import Image

    if not (os.path.isfile(a) and os.path.isfile(b)):
        return float("nan")
    x, y = (np.asarray(Image.open(p).convert("RGB"), dtype=np.int16) for p in (a, b))
    return float(np.abs(x - y).mean())


def diffusers_runs(pipeline: str, kind: str) -> bool:
    # README-cache.md: SD3Transformer2DModel has no enable_cache; only apply_mag_cache runs there.
    return pipeline.startswith("flux") or kind == "magcache"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["both", "diffusers"], default="both")
    p.add_argument("--pipeline", choices=["flux", "flux_wide", "sd3", "sd3_wide"], default="flux_wide")
    p.add_argument("--model", type=Path)
    p.add_argument("--kiln", default=str(bench.REPO / "target/release/kiln"))
    p.add_argument("--prompt", default="a photo of a cat holding a sign that says hello world")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--guidance", type=float)
    p.add_argument("--max-sequence-length", type=int, default=128)
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--dtype", default="f32", help="with --engine diffusers")
    p.add_argument("--cache", action="append", default=[], help="kiln's --cache; repeat for several")
    p.add_argument("--image", help="with --engine diffusers")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    spec = bench.PIPELINES[args.pipeline]
    args.model = args.model or bench.REPO / spec.folder
    args.guidance = spec.guidance if args.guidance is None else args.guidance
    if args.engine == "diffusers":
        print(json.dumps(run_diffusers(args)))
        return
    if not (args.model / "model_index.json").is_file():
        print(f"building {args.pipeline} in {args.model}", file=sys.stderr)
        spec.build(args.model)
    results = []
    images = tempfile.mkdtemp(prefix="bench_step_cache_")
    for dtype in args.dtypes.split(","):
        program_cache = tempfile.mkdtemp(prefix="bench_step_cache_programs_")
        for cache in [""] + args.cache:
            kind = parse_cache(cache)[0] if cache else ""
            for engine in ("diffusers", "kiln"):
                image = os.path.join(images, f"{engine}_{dtype}_{kind or 'none'}.png")
                if engine == "kiln":
                    r = run_kiln(args, dtype, cache, program_cache, image)
                elif not cache or diffusers_runs(args.pipeline, kind):
                    cmd = [sys.executable, __file__, "--engine", "diffusers", "--pipeline", args.pipeline,
                           "--model", str(args.model), "--prompt", args.prompt, "--size", str(args.size),
                           "--steps", str(args.steps), "--guidance", str(args.guidance), "--max-sequence-length",
                           str(args.max_sequence_length), "--dtype", dtype, "--image", image,
                           "--threads", str(args.threads)] + (["--cache", cache] if cache else [])
                    out, wall, foreign, _ = timed(cmd)
                    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
                    r = json.loads(lines[-1]) if out.returncode == 0 and lines else {
                        "error": (out.stderr.strip().splitlines() or ["?"])[-1][:300]}
                    r.update(process_s=wall, foreign_cpu_s=foreign)
                else:
                    continue
                r.update(engine=engine, dtype=dtype, cache=cache or "none", image=image)
                results.append(r)
                print(json.dumps(r), file=sys.stderr)
                if args.out:
                    args.out.write_text(json.dumps(results, indent=1))
    report(results, args)


def report(results, args):
    def find(engine, dtype, cache):
        return next((r for r in results if (r["engine"], r["dtype"], r["cache"]) == (engine, dtype, cache)), None)

    def f(x, d=2):
        return "" if x is None or x != x else f"{x:.{d}f}"

    print(f"\n{args.pipeline}, {args.size}x{args.size}, {args.steps} steps, guidance {args.guidance:g}; kiln "
          "--compile full (programs from disk), diffusers eager; s end to end (one call), medians of the steps\n")
    print("| dtype | cache | served kiln / diffusers | kiln s | kiln / uncached | diffusers s | kiln / diffusers "
          "| kiln step s | mean Δ to uncached kiln / diffusers | mean Δ kiln vs diffusers | foreign CPU s kiln / diffusers |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if r["engine"] != "kiln":
            continue
        d = find("diffusers", r["dtype"], r["cache"])
        base_k, base_d = find("kiln", r["dtype"], "none"), find("diffusers", r["dtype"], "none")
        if "error" in r:
            print(f"| {r['dtype']} | `{r['cache']}` | error: {r['error'][:200]} |")
            continue
        ok_d = d is not None and "error" not in d
        served = f"{r['served']}/{r['calls']} / " + (f"{d['served']}/{d['calls']}" if ok_d else "-")
        print(f"| {r['dtype']} | `{r['cache']}` | {served} | {f(r['e2e_s'])} | "
              f"{f(r['e2e_s'] / base_k['e2e_s']) if base_k and 'error' not in base_k else ''} | "
              f"{f(d['e2e_s']) if ok_d else (d or {}).get('error', '-')} | "
              f"{f(r['e2e_s'] / d['e2e_s']) if ok_d else ''} | {f(r['step_s_median'], 3)} | "
              f"{f(mean_diff(r['image'], base_k['image']), 3) if base_k else ''} / "
              f"{f(mean_diff(d['image'], base_d['image']), 3) if ok_d and base_d else '-'} | "
              f"{f(mean_diff(r['image'], d['image']), 3) if ok_d else '-'} | "
              f"{f(r['foreign_cpu_s'], 1)} / {f(d['foreign_cpu_s'], 1) if ok_d else '-'} |")


if __name__ == "__main__":
    main()
