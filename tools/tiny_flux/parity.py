"""kiln vs diffusers on the same model folder, prompts and seeds: the same image within the oracle's tolerances.

    VENV/bin/python tools/tiny_flux/parity.py [--model assets/tiny-flux] [--kiln target/release/kiln] [--dtypes f32,bf16]

For each prompt × seed and dtype it runs diffusers' FluxPipeline (diffusers_reference.py) and `kiln generate`
with the settings of <model>/kiln_defaults.json, then compares the two PNGs:
  f32:  max |Δ| ≤ 1 level and ≤ 1 % of the values differ (the oracle README's image tolerance);
  bf16: mean |Δ| ≤ 8 levels (the README's bf16 smoke-test bound: bf16 rounding differs per op between backends).
Then it scores both engines on the whole prompt-following eval (every eval.json prompt x seed, bf16, the
defaults; shapes.check): diffusers through eval_prompts.py, kiln through `kiln generate`, and the two accuracies
must agree within --max-score-gap points. Exit status 1 if any case fails. VENV has
tools/tiny_flux/requirements.txt installed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

import eval_prompts  # beside this script, on sys.path when it runs
import shapes

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [
    "a red circle on a blue background",
    "a large yellow triangle on the right, on a black background",
    "a small white square on the left, on a green background",
    "a blue triangle in the bottom right corner, on a yellow background",
]
SEEDS = [0, 1]


def compare(a: np.ndarray, b: np.ndarray) -> tuple[int, float, float]:
    d = np.abs(a.astype(np.int64) - b.astype(np.int64))
    return int(d.max()), float((d > 0).mean()), float(d.mean())


def kiln_eval_accuracy(kiln: str, model: Path, tmp: Path) -> float:
    """Accuracy of `kiln generate` (bf16, the folder's defaults) on every eval prompt x seed."""
    spec = json.loads((model / "eval.json").read_text())
    passed = total = 0
    for i, p in enumerate(spec["prompts"]):
        for seed in spec["seeds"]:
            out = tmp / f"eval_{i}_{seed}.png"
            subprocess.run([kiln, "generate", "--model", str(model), "--prompt", p["prompt"], "--seed", str(seed),
                            "--dtype", "bf16", "--device", "cpu", "--output", str(out)], check=True,
                           capture_output=True)
            ok = shapes.check(np.asarray(Image.open(out).convert("RGB")), p)["ok"]
            passed += ok
            total += 1
    return passed / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "assets" / "tiny-flux")
    ap.add_argument("--kiln", default=str(REPO / "target" / "release" / "kiln"))
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--max-score-gap", type=float, default=5.0, help="allowed accuracy difference, points")
    args = ap.parse_args()

    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for dtype in args.dtypes.split(","):
            for i, prompt in enumerate(PROMPTS):
                for seed in SEEDS:
                    ref = tmp / f"ref_{dtype}_{i}_{seed}"
                    subprocess.run([sys.executable, str(Path(__file__).parent / "diffusers_reference.py"),
                                    "--model", str(args.model), "--prompt", prompt, "--seed", str(seed),
                                    "--dtype", dtype, "--out", str(ref)], check=True, capture_output=True)
                    ours = tmp / f"kiln_{dtype}_{i}_{seed}.png"
                    subprocess.run([args.kiln, "generate", "--model", str(args.model), "--prompt", prompt,
                                    "--seed", str(seed), "--dtype", dtype, "--device", "cpu",
                                    "--output", str(ours)], check=True, capture_output=True)
                    a = np.asarray(Image.open(ours).convert("RGB"))
                    b = np.asarray(Image.open(ref / "image.png").convert("RGB"))
                    mx, frac, mean = compare(a, b)
                    ok = (mx <= 1 and frac <= 0.01) if dtype == "f32" else mean <= 8.0
                    failures += not ok
                    print(f"{'ok  ' if ok else 'FAIL'} {dtype:4} seed {seed} {prompt!r}: max |Δ| {mx}, "
                          f"{100 * frac:.2f} % differ, mean |Δ| {mean:.3f}")
        ours = kiln_eval_accuracy(args.kiln, args.model, tmp)
        theirs = eval_prompts.run(args.model, dtype="bf16")
        gap = 100 * abs(ours - theirs)
        ok = gap <= args.max_score_gap
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} eval accuracy: kiln {100 * ours:.1f} %, diffusers {100 * theirs:.1f} % "
              f"(gap {gap:.1f} points, allowed {args.max_score_gap})")
    print("parity: all cases within tolerance" if failures == 0 else f"parity: {failures} case(s) out of tolerance")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
