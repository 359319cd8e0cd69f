"""kiln vs stable-diffusion.cpp on the same FLUX.1 transformer files, side by side in one run.

The files are those `build.sh models` makes (../shared/tools/sdcpp/README.md): FLUX.1 [schnell] at its real widths
with 1 double + 2 single blocks, as a bf16 BFL-named safetensors and sd.cpp's own Q8_0 / Q4_K GGUF conversions of
it, with CLIP-L, a one-block T5-XXL and FLUX's VAE; kiln reads the same transformer file through `--transformer`
into the same weights' diffusers folder (`flux_wide_diffusers`, which supplies the config, text encoders and VAE).
Rounds alternate the engines; every process is timed alone and records foreign_cpu_s (machine-wide busy CPU
seconds during it minus its own: ~0 means nothing else ran).

sd.cpp: `sd-cli -t THREADS`, 512², 4 steps, euler, cfg 1; per step = its `sampling completed` / steps (includes its
lazy first use of the weights, as sd.cpp always does), its VAE decode, wall. kiln: `generate --compile full` on a
program cache filled by a one-step warm-up (so its timed call compiles nothing), its own per-step timings
(median), decode, end to end (text encoding + steps + decode), wall; bf16 compute. Variants: the bf16 file; each
GGUF decoded to bf16 at load, and kept quantized (`--keep-quantized`).

    python3 tools/bench_sdcpp/compare.py --sdcpp $SDCPP --kiln target/release/kiln --rounds 2 --out sdcpp.json
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench_flux"))
from step_cache import timed  # noqa: E402  (one way of timing a process for both tools)


def transformer_file(models: Path, variant: str) -> Path:
    return models / ("flux1-wide-1d2s-bf16.safetensors" if variant == "bf16" else f"flux1-wide-1d2s-{variant}.gguf")


def run_sdcpp(args, variant: str, png: str) -> dict:
    m = args.sdcpp / "models"
    cmd = [str(args.sdcpp / "src/build/bin/sd-cli"), "--diffusion-model", str(transformer_file(m, variant)),
           "--clip_l", str(m / "clip_l-random-fp16.safetensors"), "--t5xxl", str(m / "t5xxl-1block-random-fp16.safetensors"),
           "--vae", str(m / "ae-random.safetensors"), "-p", args.prompt, "--cfg-scale", "1.0",
           "--sampling-method", "euler", "--steps", str(args.steps), "-H", str(args.size), "-W", str(args.size),
           "--seed", "42", "-t", str(args.threads), "-v", "-o", png]
    out, wall, foreign, _ = timed(cmd)
    log = out.stdout + out.stderr
    if out.returncode:
        return {"error": log.strip().splitlines()[-1][:300] if log.strip() else f"exit {out.returncode}"}

    def last(pattern):
        found = re.findall(pattern, log)
        return float(found[-1]) if found else float("nan")

    sampling = last(r"sampling completed, taking ([0-9.]+)")
    return {"step_s": sampling / args.steps, "decode_s": last(r"decode_first_stage completed, taking ([0-9.]+)"),
            "text_s": last(r"get_learned_condition completed, taking ([0-9.]+)"),
            "e2e_s": last(r"generate_image completed in ([0-9.]+)"), "wall_s": wall, "foreign_cpu_s": foreign}


def run_kiln(args, variant: str, keep: bool, program_cache: str, png: str) -> dict:
    m = args.sdcpp / "models"
    common = [args.kiln, "generate", "--model", str(m / "flux_wide_diffusers"), "--transformer",
              str(transformer_file(m, variant)), "--prompt", args.prompt, "--height", str(args.size), "--width",
              str(args.size), "--seed", "42", "--dtype", "bf16", "--device", "cpu", "--compile", "full"]
    if keep:
        common.append("--keep-quantized")
    env = {"KILN_CACHE_DIR": program_cache, "TF_CPP_MIN_LOG_LEVEL": "2"}
    with tempfile.TemporaryDirectory() as tmp:
        warm, _, _, _ = timed([*common, "--num-inference-steps", "1", "--output", f"{tmp}/w.png"], env)
        if warm.returncode:
            return {"error": "warm-up: " + (warm.stderr.strip().splitlines() or ["?"])[-1][:300]}
        out, wall, foreign, rss = timed([*common, "--num-inference-steps", str(args.steps), "--output", png,
                                         "--timings", f"{tmp}/t.json"], env)
        if out.returncode:
            return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:300]}
        timings = json.loads(Path(f"{tmp}/t.json").read_text())
    call = timings["calls"][-1]
    device = re.search(r"^weights: .*?transformer ([0-9.]+) MiB", out.stderr, re.M)
    return {"step_s": statistics.median(call["steps_s"]), "decode_s": call["decoding_s"],
            "text_s": call["text_encoding_s"], "e2e_s": call["total_s"], "wall_s": wall, "foreign_cpu_s": foreign,
            "programs_compiled": call["programs_compiled"], "peak_rss_mib": rss,
            "transformer_device_mib": float(device[1]) if device else None}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sdcpp", type=Path, default=os.environ.get("SDCPP"), help="build.sh's scratch folder")
    p.add_argument("--kiln", default=str(Path(__file__).resolve().parents[2] / "target/release/kiln"))
    p.add_argument("--variants", default="bf16,q8_0,q4_K")
    p.add_argument("--prompt", default="a photo of a cat")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.sdcpp is None:
        p.error("--sdcpp (or SDCPP) is needed")
    results = []
    images = tempfile.mkdtemp(prefix="bench_sdcpp_")
    program_cache = tempfile.mkdtemp(prefix="bench_sdcpp_kiln_programs_")
    for round_ in range(args.rounds):
        for variant in args.variants.split(","):
            runs = [("sd.cpp", False), ("kiln", False)] + ([("kiln", True)] if variant != "bf16" else [])
            for engine, keep in runs:
                png = os.path.join(images, f"{engine}_{variant}_{'kept' if keep else 'plain'}_{round_}.png")
                r = run_sdcpp(args, variant, png) if engine == "sd.cpp" else run_kiln(
                    args, variant, keep, program_cache, png)
                r.update(engine=engine, variant=variant, kept=keep, round=round_)
                results.append(r)
                print(json.dumps(r), file=sys.stderr)
                if args.out:
                    args.out.write_text(json.dumps(results, indent=1))
    report(results, args)


def report(results, args):
    def med(rows, key):
        v = [r[key] for r in rows if key in r and r[key] is not None and r[key] == r[key]]
        return statistics.median(v) if v else float("nan")

    def f(x, d=2):
        return "" if x != x else f"{x:.{d}f}"

    groups = {}
    for r in results:
        groups.setdefault((r["engine"], r["variant"], r["kept"]), []).append(r)
    kiln_bf16 = med(groups.get(("kiln", "bf16", False), []), "step_s")
    print(f"\nFLUX.1 [schnell] real widths (1 double + 2 single blocks of 3072), {args.size}², {args.steps} steps, "
          f"{args.threads} threads, medians of {args.rounds} round(s)\n")
    print("| engine | transformer file | s / step | step / kiln bf16 | step / sd.cpp same file | VAE decode s | "
          "end to end s | e2e / sd.cpp same file | wall s | transformer MiB on device | foreign CPU s | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (engine, variant, kept), rows in groups.items():
        sd = groups.get(("sd.cpp", variant, False), [])
        step, e2e = med(rows, "step_s"), med(rows, "e2e_s")
        errors = "; ".join(sorted({r["error"] for r in rows if "error" in r}))[:200]
        name = variant + (" kept quantized" if kept else (" decoded to bf16" if engine == "kiln" and variant != "bf16" else ""))
        print(f"| {engine} | {name} | {f(step, 3)} | {f(step / kiln_bf16)} | {f(step / med(sd, 'step_s'))} | "
              f"{f(med(rows, 'decode_s'))} | {f(e2e)} | {f(e2e / med(sd, 'e2e_s'))} | {f(med(rows, 'wall_s'), 1)} | "
              f"{f(med(rows, 'transformer_device_mib'), 0)} | {f(max((r.get('foreign_cpu_s', 0) for r in rows)), 1)} | "
              f"{errors} |")


if __name__ == "__main__":
    main()
