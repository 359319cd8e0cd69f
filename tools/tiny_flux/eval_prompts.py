"""Does the tiny pipeline follow the prompt? Generate every eval prompt x seed with diffusers' FluxPipeline and
check background colour, shape colour, shape type and position with plain pixel statistics (shapes.analyse).

    python tools/tiny_flux/eval_prompts.py --model assets/tiny-flux [--dtype bf16|f32] [--steps N] [--write-results]

Prompts, seeds, palette and check parameters come from <model>/eval.json; defaults (size, steps, ...) from
<model>/kiln_defaults.json. Each image is one pipeline call with generator=torch.Generator('cpu').manual_seed(seed).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from diffusers import FluxPipeline
from PIL import Image

import shapes

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def load_pipeline(model: Path, dtype: str) -> FluxPipeline:
    pipe = FluxPipeline.from_pretrained(model, dtype=DTYPES[dtype])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe: FluxPipeline, defaults: dict, prompt: str, seed: int, steps: int | None = None) -> np.ndarray:
    image = pipe(
        prompt,
        height=defaults["height"],
        width=defaults["width"],
        num_inference_steps=steps or defaults["num_inference_steps"],
        guidance_scale=defaults["guidance_scale"],
        max_sequence_length=defaults["max_sequence_length"],
        generator=torch.Generator("cpu").manual_seed(seed),
    ).images[0]
    return np.asarray(image.convert("RGB"))


def run(model: Path, dtype: str = "bf16", steps: int | None = None, write_results: bool = False,
        grid: Path | None = None, threads: int = 1, any_model: bool = False) -> float:
    torch.set_num_threads(threads)
    spec = json.loads(json.dumps(shapes.eval_spec()))
    if not any_model and spec != json.loads((model / "eval.json").read_text()):
        raise SystemExit(f"{model / 'eval.json'} differs from shapes.eval_spec(): re-run train.py or update it")
    defaults = json.loads((model / "kiln_defaults.json").read_text())
    pipe = load_pipeline(model, dtype)
    n_steps = steps or defaults["num_inference_steps"]
    results, tiles = [], []
    t0 = time.time()
    for p in spec["prompts"]:
        row = []
        for seed in spec["seeds"]:
            img = generate(pipe, defaults, p["prompt"], seed, n_steps)
            r = shapes.check(img, p)
            results.append({"prompt": p["prompt"], "seed": seed, **r})
            row.append(img)
            if not r["ok"]:
                print(f"FAIL seed {seed} {p['prompt']!r}: got background {r['background']}, colour {r['color']}, "
                      f"shape {r['shape']}, column {r['column']}, row {r['row']} (centroid {r['centroid']})")
        tiles.append(np.concatenate(row, axis=1))
    elapsed = time.time() - t0
    n = len(results)
    acc = sum(r["ok"] for r in results) / n
    named = [r for r, p in zip(results, [p for p in spec["prompts"] for _ in spec["seeds"]]) if p["position"]]
    summary = {
        "dtype": dtype,
        "num_inference_steps": n_steps,
        "images": n,
        "accuracy": acc,
        "background_accuracy": sum(r["background_ok"] for r in results) / n,
        "color_accuracy": sum(r["color_ok"] for r in results) / n,
        "shape_accuracy": sum(r["shape_ok"] for r in results) / n,
        "position_accuracy": sum(r["position_ok"] for r in named) / max(1, len(named)),
        "seconds": round(elapsed, 1),
    }
    print(json.dumps(summary))
    print(f"accuracy {acc * 100:.1f} % ({sum(r['ok'] for r in results)}/{n}), {dtype}, {n_steps} steps, "
          f"{elapsed / n:.2f} s/image")
    if write_results:
        out = {"summary": summary, "results": results}
        (model / f"eval_results_{dtype}.json").write_text(json.dumps(out, indent=1) + "\n")
    if grid is not None:
        Image.fromarray(np.concatenate(tiles, axis=0)).save(grid)
    return acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path(__file__).resolve().parents[2] / "assets" / "tiny-flux")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--steps", type=int, default=None, help="override kiln_defaults.json num_inference_steps")
    ap.add_argument("--write-results", action="store_true", help="write <model>/eval_results_<dtype>.json")
    ap.add_argument("--grid", type=Path, default=None, help="save all images as one PNG (rows = prompts)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--any-model", action="store_true",
                    help="evaluate a folder whose eval.json is older than shapes.py (e.g. a previous model)")
    args = ap.parse_args()
    run(args.model, args.dtype, args.steps, args.write_results, args.grid, args.threads, args.any_model)


if __name__ == "__main__":
    main()
