#!/usr/bin/env python3
"""kiln vs diffusers (torch eager) on one scaled FLUX.1 model, side by side in one run.

Builds (once) a FLUX.1 pipeline with random weights and a scaled config — 2 double + 4 single
blocks, width 512 (8 heads x 64), a small CLIP, T5 and VAE — saves it with diffusers, then times
both engines on the same folder, prompt, size and steps, f32 and bf16, each in its own process:
seconds per denoising step, end-to-end seconds, peak resident memory, and kiln's time per op kind.

    VENV/bin/python tools/bench_flux/bench.py --kiln target/release/kiln

VENV has tools/tiny_flux/requirements.txt installed (torch, diffusers, transformers pinned).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ORACLE_TOKENIZERS = REPO / "fixtures/oracle/tokenizers"


def build_model(folder: Path, seed: int = 0) -> None:
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=64,
        num_attention_heads=8, joint_attention_dim=512, pooled_projection_dim=256,
        guidance_embeds=True, axes_dims_rope=(16, 24, 24),
    )
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, hidden_act="quick_gelu",
        projection_dim=256, eos_token_id=2, bos_token_id=0, pad_token_id=1,
    ))
    t5 = T5EncoderModel(T5Config(
        vocab_size=32128, d_model=512, d_kv=64, d_ff=1024, num_layers=2, num_heads=8,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
        relative_attention_max_distance=128, is_encoder_decoder=False,
    ))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(64, 128, 256, 256),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=2, norm_num_groups=32, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler, text_encoder=clip, tokenizer=CLIPTokenizer.from_pretrained(ORACLE_TOKENIZERS / "clip"),
        text_encoder_2=t5, tokenizer_2=T5TokenizerFast.from_pretrained(ORACLE_TOKENIZERS / "t5"),
        transformer=transformer, vae=vae,
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def peak_rss_mib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_diffusers(args) -> dict:
    import torch
    from diffusers import FluxPipeline

    torch.set_num_threads(args.threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    t = time.perf_counter()
    pipe = FluxPipeline.from_pretrained(args.model, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    load_s = time.perf_counter() - t
    step_times = []

    def call():
        marks = [time.perf_counter()]

        def on_step(p, i, ts, kw):
            marks.append(time.perf_counter())
            return kw

        t0 = time.perf_counter()
        pipe(args.prompt, height=args.height, width=args.width, num_inference_steps=args.steps,
             guidance_scale=args.guidance, max_sequence_length=args.max_sequence_length,
             generator=torch.Generator("cpu").manual_seed(0), callback_on_step_end=on_step)
        e2e = time.perf_counter() - t0
        # The first mark is the call start; the first step also contains text encoding.
        return e2e, [b - a for a, b in zip(marks[1:], marks[2:])]

    with torch.inference_mode():
        t = time.perf_counter()
        call()
        first_call_s = time.perf_counter() - t
        e2e = []
        for _ in range(args.runs):
            e, steps = call()
            e2e.append(e)
            step_times.extend(steps)
    return {
        "engine": "diffusers", "dtype": args.dtype, "load_s": load_s, "first_call_s": first_call_s,
        "step_s_median": statistics.median(step_times) if step_times else float("nan"),
        "e2e_s_median": statistics.median(e2e), "peak_rss_mib": peak_rss_mib(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }


def run_engine(engine: str, args, dtype: str) -> dict:
    if engine == "kiln":
        cmd = [args.kiln, "bench", "--model", str(args.model), "--prompt", args.prompt,
               "--height", str(args.height), "--width", str(args.width), "--steps", str(args.steps),
               "--guidance", str(args.guidance), "--max-sequence-length", str(args.max_sequence_length),
               "--dtype", dtype, "--device", "cpu", "--runs", str(args.runs), "--json"]
    else:
        cmd = [sys.executable, __file__, "--engine", "diffusers", "--model", str(args.model),
               "--prompt", args.prompt, "--height", str(args.height), "--width", str(args.width),
               "--steps", str(args.steps), "--guidance", str(args.guidance),
               "--max-sequence-length", str(args.max_sequence_length), "--dtype", dtype,
               "--runs", str(args.runs), "--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    line = [l for l in out.stdout.splitlines() if l.startswith("{")][-1]
    return json.loads(line)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["both", "diffusers"], default="both")
    p.add_argument("--model", type=Path, default=REPO / "target/bench_flux_model")
    p.add_argument("--kiln", default=str(REPO / "target/release/kiln"))
    p.add_argument("--prompt", default="a photo of a cat holding a sign that says hello world")
    p.add_argument("--height", type=int, default=512)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--guidance", type=float, default=3.5)
    p.add_argument("--max-sequence-length", type=int, default=128)
    p.add_argument("--dtype", default="f32")
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="alternate the engines this many times")
    p.add_argument("--out", type=Path, help="write all results as JSON")
    args = p.parse_args()

    if args.engine == "diffusers":
        print(json.dumps(run_diffusers(args)))
        return
    if not (args.model / "model_index.json").is_file():
        print(f"building the scaled model in {args.model}", file=sys.stderr)
        build_model(args.model)
    results = []
    for dtype in args.dtypes.split(","):
        for _ in range(args.rounds):
            for engine in ("diffusers", "kiln"):
                r = run_engine(engine, args, dtype)
                results.append(r)
                print(f"{engine:9} {dtype:4}: step {r['step_s_median']:.3f} s, end to end {r['e2e_s_median']:.3f} s, "
                      f"peak {r['peak_rss_mib']:.0f} MiB, first call {r['first_call_s']:.2f} s", file=sys.stderr)
    print(f"\nscaled FLUX.1 (2+4 blocks, width 512), {args.height}x{args.width}, {args.steps} steps, text length "
          f"{args.max_sequence_length}, {args.threads} threads")
    print("| dtype | engine | s/step | end-to-end s | peak RSS MiB | kiln/diffusers (step, e2e) |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        rows = {e: [r for r in results if r["engine"] == e and r["dtype"] == dtype] for e in ("diffusers", "kiln")}
        med = {e: {k: statistics.median(r[k] for r in rs) for k in ("step_s_median", "e2e_s_median", "peak_rss_mib")}
               for e, rs in rows.items()}
        for e in ("diffusers", "kiln"):
            ratio = ""
            if e == "kiln":
                ratio = (f"{med['kiln']['step_s_median'] / med['diffusers']['step_s_median']:.2f}, "
                         f"{med['kiln']['e2e_s_median'] / med['diffusers']['e2e_s_median']:.2f}")
            print(f"| {dtype} | {e} | {med[e]['step_s_median']:.3f} | {med[e]['e2e_s_median']:.3f} | "
                  f"{med[e]['peak_rss_mib']:.0f} | {ratio} |")
    for dtype in args.dtypes.split(","):
        k = [r for r in results if r["engine"] == "kiln" and r["dtype"] == dtype][-1]
        print(f"\nkiln {dtype}: time per op kind (one profiled call)")
        for o in k["ops"][:12]:
            print(f"  {o['op']:<20} {o['calls']:5} calls {o['total_s']:8.3f} s {100 * o['share']:5.1f} %")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
