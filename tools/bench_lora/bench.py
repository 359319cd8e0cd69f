#!/usr/bin/env python3
"""LoRA adapters, kiln against diffusers + peft, side by side in one run: what an adapter costs per
step, and what switching adapters costs.

kiln merges an adapter into the weights (W + w * alpha/r * B A, on the weights' device; the model's
programs take weights as arguments, so nothing recompiles): a step with an adapter is the step
without one, and switching costs one merge of every adapted weight (and putting the base weights
back). diffusers + peft either runs the low-rank path in every adapted Linear (unfused:
W x + s B (A x), switching is setting scalars) or merges (`fuse_lora`, like kiln; switching is
unfuse + fuse).

The model is tools/bench_flux's scaled FLUX.1 (2 double + 4 single blocks of width 512; built once
in target/bench_flux_model); the adapter is a diffusers/PEFT file adapting every Linear of the
transformer (rank --rank, random factors), written once next to it. Per process (one per engine
and mode, alternating engines over --rounds): the median step and end to end of --runs calls
after a first call, and the median switch times.

    VENV/bin/python tools/bench_lora/bench.py --kiln target/release/kiln --rounds 3 --out lora.json

kiln rows: `kiln bench --compile none|full` without and with `--lora` (the latter also times
removing the adapter and merging it again). diffusers rows: eager without an adapter, with it
unfused, with it fused; switch = `set_adapters` to other weights (unfused) and `unfuse_lora()` +
`fuse_lora()` (fused), medians of --runs.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "bench_flux"))
NAN = float("nan")


def lora_file(model: Path, rank: int) -> Path:
    """A PEFT adapter of every Linear of the transformer at `rank` (A ~ N(0, 1/in), B ~ N(0, 0.25/r))."""
    path = model.parent / f"{model.name}_lora_r{rank}.safetensors"
    if path.exists():
        return path
    import torch
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    transformer = FluxTransformer2DModel.from_pretrained(model / "transformer")
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear):
            out_f, in_f = module.weight.shape
            tensors[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) / math.sqrt(in_f)
            tensors[f"transformer.{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * (0.5 / math.sqrt(rank))
    save_file(tensors, str(path))
    return path


def run_diffusers(args) -> dict:
    import diffusers
    import torch

    torch.set_num_threads(args.threads)
    pipe = diffusers.FluxPipeline.from_pretrained(args.model, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    result = {"engine": "diffusers", "mode": args.diffusers_mode, "torch": torch.__version__}
    if args.diffusers_mode != "base":
        pipe.load_lora_weights(args.lora, adapter_name="a")
        pipe.set_adapters(["a"], adapter_weights=[args.scale])
        if args.diffusers_mode == "fused":
            pipe.fuse_lora(lora_scale=1.0)

    def call():
        marks = [time.perf_counter()]

        def on_step(p, i, ts, kw):
            marks.append(time.perf_counter())
            return kw

        t0 = time.perf_counter()
        pipe(prompt=args.prompt, height=args.size, width=args.size, num_inference_steps=args.steps,
             guidance_scale=3.5, max_sequence_length=128, generator=torch.Generator("cpu").manual_seed(0),
             callback_on_step_end=on_step)
        return time.perf_counter() - t0, [b - a for a, b in zip(marks[1:], marks[2:])]

    with torch.inference_mode():
        call()
        e2e, steps = [], []
        for _ in range(args.runs):
            e, s = call()
            e2e.append(e)
            steps.extend(s)
        switch = []
        for i in range(args.runs):
            t = time.perf_counter()
            if args.diffusers_mode == "unfused":
                pipe.set_adapters(["a"], adapter_weights=[args.scale * (0.5 if i % 2 == 0 else 1.0)])
            elif args.diffusers_mode == "fused":
                pipe.unfuse_lora()
                pipe.fuse_lora(lora_scale=1.0)
            switch.append((time.perf_counter() - t) * 1e3)
    result["step_s_median"] = statistics.median(steps) if steps else NAN
    result["e2e_s_median"] = statistics.median(e2e)
    result["switch_ms_median"] = statistics.median(switch) if args.diffusers_mode != "base" else NAN
    return result


def run_process(cmd, env=None) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})})
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode == 0 and lines:
        return json.loads(lines[-1])
    last = (out.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit status {out.returncode}: {last}"[:2000]}


def kiln_row(args, lora: Path, mode: str, with_lora: bool) -> dict:
    cmd = [args.kiln, "bench", "--model", str(args.model), "--prompt", args.prompt, "--height", str(args.size),
           "--width", str(args.size), "--steps", str(args.steps), "--guidance", "3.5", "--max-sequence-length", "128",
           "--runs", str(args.runs), "--device", "cpu", "--compile", mode, "--json"]
    if with_lora:
        cmd += ["--lora", str(lora), "--lora-scale", str(args.scale)]
    r = run_process(cmd)
    r.update(engine="kiln", mode=f"{mode}{' + lora' if with_lora else ''}")
    r["switch_ms_median"] = r.get("lora_merge_ms") or NAN
    return r


def diffusers_row(args, lora: Path, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--engine", "diffusers", "--model", str(args.model), "--lora", str(lora),
           "--diffusers-mode", mode, "--size", str(args.size), "--steps", str(args.steps), "--runs", str(args.runs),
           "--scale", str(args.scale), "--threads", str(args.threads)]
    r = run_process(cmd)
    r.update(engine="diffusers", mode=mode)
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["both", "diffusers"], default="both", help=argparse.SUPPRESS)
    p.add_argument("--diffusers-mode", default="base", help=argparse.SUPPRESS)
    p.add_argument("--lora", default="", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, default=REPO / "target/bench_flux_model")
    p.add_argument("--kiln", default=str(REPO / "target/release/kiln"))
    p.add_argument("--prompt", default="a photo of a cat holding a sign that says hello world")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--scale", type=float, default=0.8)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.engine == "diffusers":
        print(json.dumps(run_diffusers(args)))
        return
    if not (args.model / "model_index.json").exists():
        import bench as bench_flux
        bench_flux.build_flux(args.model)
    lora = lora_file(args.model, args.rank)
    rows = []
    for r in range(args.rounds):
        for run in [lambda: kiln_row(args, lora, "none", False), lambda: diffusers_row(args, lora, "base"),
                    lambda: kiln_row(args, lora, "none", True), lambda: diffusers_row(args, lora, "unfused"),
                    lambda: kiln_row(args, lora, "full", False), lambda: diffusers_row(args, lora, "fused"),
                    lambda: kiln_row(args, lora, "full", True)]:
            row = run()
            row["round"] = r
            rows.append(row)
            print(json.dumps({k: row.get(k) for k in ("engine", "mode", "round", "step_s_median", "e2e_s_median",
                                                       "switch_ms_median", "lora_unmerge_ms", "error")}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))

    def med(engine, mode, key):
        v = [r.get(key, NAN) for r in rows if r["engine"] == engine and r["mode"] == mode]
        v = [x for x in v if isinstance(x, (int, float)) and not math.isnan(x)]
        return statistics.median(v) if v else NAN

    print(f"\nscaled FLUX.1, {args.size}^2, {args.steps} steps, f32, rank-{args.rank} adapter on every transformer "
          f"Linear, medians of {args.rounds} round(s)")
    print("| engine | mode | step s | step vs its base | end to end s | switch ms |")
    print("|---|---|---|---|---|---|")
    bases = {("kiln", "none + lora"): "none", ("kiln", "full + lora"): "full", ("diffusers", "unfused"): "base",
             ("diffusers", "fused"): "base"}
    for engine, mode in [("kiln", "none"), ("kiln", "none + lora"), ("kiln", "full"), ("kiln", "full + lora"),
                         ("diffusers", "base"), ("diffusers", "unfused"), ("diffusers", "fused")]:
        step = med(engine, mode, "step_s_median")
        base = bases.get((engine, mode))
        ratio = step / med(engine, base, "step_s_median") if base else NAN
        print(f"| {engine} | {mode} | {step:.3f} | {ratio:.3f} | {med(engine, mode, 'e2e_s_median'):.3f} | "
              f"{med(engine, mode, 'switch_ms_median'):.1f} |")
    print(f"kiln: removing the adapter (base weights back) {med('kiln', 'none + lora', 'lora_unmerge_ms'):.1f} ms "
          f"(eager process), {med('kiln', 'full + lora', 'lora_unmerge_ms'):.1f} ms (full)")


if __name__ == "__main__":
    main()
