"""Reference run of diffusers' FluxPipeline on a model folder, for parity checks of kiln.

    python tools/tiny_flux/diffusers_reference.py --model assets/tiny-flux --prompt "a red circle on a blue background" \
        --seed 0 --out /tmp/ref [--dtype bf16|f32] [--steps N] [--height H] [--width W]

Unset options come from <model>/kiln_defaults.json. Writes to --out:
  image.png             the pipeline's PIL output
  tensors.safetensors   every tensor in the dtype the pipeline produced it (bf16 or f32):
      prompt_embeds (1, S_txt, D_t5), pooled_prompt_embeds (1, D_clip), text_ids (S_txt, 3), img_ids (S_img, 3),
      noise (1, S_img, 64)                  packed initial latents (transformer input of step 0)
      timestep_<i> (1,)                     the `timestep` the transformer receives at step i (= t/1000)
      velocity_<i> (1, S_img, 64)           transformer output at step i
      latents_<i> (1, S_img, 64)            latents after scheduler step i (latents_<N-1> = final latents)
      vae_input (1, 16, H/8, W/8)           unpacked latents / scaling_factor + shift_factor, as vae.decode gets it
      decoded (1, 3, H, W)                  raw vae.decode output in [-1, 1] (before clamp / uint8)
      image (H, W, 3) float32               what output_type="np" returns: clamp(decoded/2 + 0.5, 0, 1) in the
                                            VAE dtype, then float32 (image.png = round(image * 255))
  call.json             the call (prompt, seed, dtype, sizes, steps, sigmas, timesteps) and tensor summaries
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from diffusers import FluxPipeline
from safetensors.torch import save_file

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--guidance-scale", type=float, default=None)
    ap.add_argument("--max-sequence-length", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    defaults_path = args.model / "kiln_defaults.json"
    defaults = json.loads(defaults_path.read_text()) if defaults_path.exists() else {}

    def pick(value, key):
        if value is not None:
            return value
        if key not in defaults:
            raise SystemExit(f"--{key.replace('_', '-')} not given and {defaults_path} has no {key!r}")
        return defaults[key]

    call = {
        "prompt": args.prompt,
        "height": pick(args.height, "height"),
        "width": pick(args.width, "width"),
        "num_inference_steps": pick(args.steps, "num_inference_steps"),
        "guidance_scale": pick(args.guidance_scale, "guidance_scale"),
        "max_sequence_length": pick(args.max_sequence_length, "max_sequence_length"),
    }

    pipe = FluxPipeline.from_pretrained(args.model, dtype=DTYPES[args.dtype])
    pipe.set_progress_bar_config(disable=True)
    captured: dict[str, torch.Tensor] = {}
    step = {"i": 0}

    def transformer_hook(_module, _args, kwargs, output):
        i = step["i"]
        if i == 0:
            captured["noise"] = kwargs["hidden_states"]
            captured["text_ids"] = kwargs["txt_ids"]
            captured["img_ids"] = kwargs["img_ids"]
        captured[f"timestep_{i}"] = kwargs["timestep"]
        captured[f"velocity_{i}"] = output[0] if isinstance(output, tuple) else output.sample

    def on_step_end(_pipe, i, _t, callback_kwargs):
        captured[f"latents_{i}"] = callback_kwargs["latents"]
        captured.setdefault("prompt_embeds", callback_kwargs["prompt_embeds"])
        step["i"] = i + 1
        return callback_kwargs

    decode = pipe.vae.decode

    def decode_and_capture(z, *a, **kw):
        captured["vae_input"] = z
        out = decode(z, *a, **kw)
        captured["decoded"] = out[0] if isinstance(out, tuple) else out.sample
        return out

    pipe.vae.decode = decode_and_capture
    pooled = {}
    clip_forward = pipe.text_encoder.forward

    def clip_capture(*a, **kw):
        out = clip_forward(*a, **kw)
        pooled["pooled"] = out.pooler_output
        return out

    pipe.text_encoder.forward = clip_capture
    handle = pipe.transformer.register_forward_hook(transformer_hook, with_kwargs=True)
    result = pipe(
        **call,
        generator=torch.Generator("cpu").manual_seed(args.seed),
        callback_on_step_end=on_step_end,
        callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"],
    )
    handle.remove()
    captured["pooled_prompt_embeds"] = pooled["pooled"].to(captured["prompt_embeds"].dtype)
    # the pipeline's own post-processing (denormalise + clamp in the VAE dtype, then float32)
    captured["image"] = torch.from_numpy(pipe.image_processor.postprocess(captured["decoded"], output_type="np")[0])

    args.out.mkdir(parents=True, exist_ok=True)
    result.images[0].save(args.out / "image.png")
    tensors = {k: v.detach().cpu().contiguous() for k, v in captured.items()}
    save_file(tensors, args.out / "tensors.safetensors", metadata={"format": "pt"})
    summary = {
        k: {
            "shape": list(v.shape),
            "dtype": str(v.dtype).replace("torch.", ""),
            "mean": float(v.float().mean()),
            "std": float(v.float().std()) if v.numel() > 1 else 0.0,
            "absmax": float(v.float().abs().max()),
        }
        for k, v in sorted(tensors.items())
    }
    record = {
        "model": str(args.model),
        "dtype": args.dtype,
        "seed": args.seed,
        "generator": "torch.Generator('cpu').manual_seed(seed)",
        "call_kwargs": call,
        "sigmas": pipe.scheduler.sigmas.tolist(),
        "timesteps": pipe.scheduler.timesteps.tolist(),
        "vae_scaling_factor": pipe.vae.config.scaling_factor,
        "vae_shift_factor": pipe.vae.config.shift_factor,
        "image_uint8_sum": int(np.asarray(result.images[0]).astype(np.int64).sum()),
        "tensors": summary,
        "versions": {"torch": torch.__version__, "diffusers": __import__("diffusers").__version__,
                     "transformers": __import__("transformers").__version__},
    }
    (args.out / "call.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}/image.png, tensors.safetensors ({len(tensors)} tensors), call.json")


if __name__ == "__main__":
    main()
