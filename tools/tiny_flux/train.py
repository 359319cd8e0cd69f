"""Train the tiny FLUX.1-architecture pipeline that `kiln generate` uses by default.

    python tools/tiny_flux/train.py --out assets/tiny-flux

Phases: synthetic data (shapes.py) -> AutoencoderKL (reconstruction + small KL) -> latent statistics ->
FluxTransformer2DModel + T5 + CLIP layers with a shape-weighted rectified-flow objective -> save in the
FLUX.1 diffusers layout, bf16 -> prompt-following eval (eval_prompts.py). See README.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from safetensors.torch import load_file, save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

import shapes

REPO = Path(__file__).resolve().parents[2]
ORACLE_TOKENIZERS = REPO / "fixtures" / "oracle" / "tokenizers"

HEIGHT = WIDTH = shapes.IMAGE_SIZE
MAX_SEQUENCE_LENGTH = 40  # the longest caption is 37 T5 tokens (incl. </s>)
CLIP_LENGTH = 77  # CLIPTokenizer.model_max_length; FluxPipeline always pads CLIP to it
DEFAULT_STEPS = 8

VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 3,
    up_block_types=["UpDecoderBlock2D"] * 3,
    block_out_channels=[16, 32, 64],  # vae_scale_factor 4: 64x64 px <-> 16x16x16 latents -> 64 packed tokens
    layers_per_block=1,
    act_fn="silu",
    latent_channels=16,
    # few groups: GroupNorm removes each group's mean/variance, and with 1-2 channels per group the colour of a
    # flat image (what this data set is made of) is normalised away and cannot be reconstructed
    norm_num_groups=4,
    sample_size=HEIGHT,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=True,
    force_upcast=True,
)
CLIP_CONFIG = dict(
    vocab_size=49408,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=CLIP_LENGTH,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    projection_dim=32,
    bos_token_id=0,
    pad_token_id=1,
    eos_token_id=2,  # legacy value as in the real FLUX.1 config: pooled output taken at argmax(input_ids)
)
T5_CONFIG = dict(
    vocab_size=2128,  # 2000 sentencepiece + 100 sentinels + 28 padding rows (as 32128 in T5 v1.1)
    d_model=64,
    d_kv=16,
    d_ff=128,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    dropout_rate=0.0,
    layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
    use_cache=False,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)
TRANSFORMER_CONFIG = dict(
    patch_size=1,
    in_channels=64,
    out_channels=None,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=32,
    num_attention_heads=4,
    joint_attention_dim=T5_CONFIG["d_model"],
    pooled_projection_dim=CLIP_CONFIG["hidden_size"],
    guidance_embeds=False,
    axes_dims_rope=[8, 12, 12],
)
SCHEDULER_CONFIG = dict(  # FLUX.1-schnell values
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=False,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def reinit_random(model: torch.nn.Module, seed: int) -> None:
    """Fixed random weights, the oracle's scheme: matrices N(0, 1/fan_in), *norm*.weight 1+N(0, 0.1^2),
    other 1-D N(0, 0.05^2); one CPU generator visiting named_parameters() in order."""
    gen = torch.Generator("cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p.numel() // p.shape[0]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))


def cosine_lr(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def to_pixels(images_u8: np.ndarray) -> torch.Tensor:
    """(N,H,W,3) uint8 -> (N,3,H,W) float32 in [-1, 1]."""
    return torch.from_numpy(images_u8).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def to_uint8(pixels: torch.Tensor) -> np.ndarray:
    """(N,3,H,W) in [-1,1] -> (N,H,W,3) uint8 exactly as FluxPipeline post-processes (clamp, x255, round)."""
    x = (pixels.float() * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    return (x * 255).round().astype(np.uint8)


class Budget:
    def __init__(self, minutes: float | None):
        self.deadline = None if minutes is None else time.time() + 60 * minutes

    def over(self) -> bool:
        return self.deadline is not None and time.time() > self.deadline


# ---------------------------------------------------------------------------------------------------------


def edge_mask(shape: torch.Tensor) -> torch.Tensor:
    """(N, 1, H, W) 1 where a 3x3 neighbourhood of the shape mask holds both shape and background (the outline)."""
    return F.max_pool2d(shape, 3, 1, 1) + F.max_pool2d(-shape, 3, 1, 1)


def shape_mask(images: np.ndarray, attrs: list[dict]) -> torch.Tensor:
    """(N, 1, H, W) 1 on the pixels farther than the check's threshold from the background colour."""
    bg = np.array([shapes.PALETTE[a["background"]] for a in attrs], dtype=np.float32)[:, None, None, :]
    far = np.linalg.norm(images.astype(np.float32) - bg, axis=3) > shapes.SHAPE_THRESHOLD
    return torch.from_numpy(far.astype(np.float32))[:, None]


def train_vae(args, images: np.ndarray, captions_attrs: list[dict]) -> AutoencoderKL:
    torch.manual_seed(args.seed + 10)
    if args.vae_init is not None:  # fine-tune a saved VAE (stored in bf16)
        vae = AutoencoderKL.from_pretrained(args.vae_init, torch_dtype=torch.float32)
        log(f"vae: starting from {args.vae_init}")
    else:
        vae = AutoencoderKL(**VAE_CONFIG)
        with torch.no_grad():  # start with a small posterior std (logvar half of conv_out) so that the decoder
            vae.encoder.conv_out.bias[VAE_CONFIG["latent_channels"] :] = -6.0  # is not first drowned in noise
    opt = torch.optim.Adam(vae.parameters(), lr=args.vae_lr)
    gen = torch.Generator("cpu").manual_seed(args.seed + 11)
    n_train = len(images) - 256
    held_out = to_pixels(images[n_train:])
    budget = Budget(args.max_minutes_vae)
    t0 = time.time()
    run_loss = run_kl = 0.0
    for step in range(args.vae_steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, args.vae_steps, args.vae_lr, 50)
        idx = torch.randint(0, n_train, (args.vae_batch,), generator=gen).numpy()
        x = to_pixels(images[idx])
        post = vae.encode(x).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen)
        y = vae.decode(z).sample
        if args.vae_edge_weight == 0:  # the loss stages 1-3 used
            rec = F.mse_loss(y, x) + 0.5 * F.l1_loss(y, x)
        else:
            # outline-weighted reconstruction: 1 + vae_edge_weight on the pixels along the shape's outline
            w = 1.0 + args.vae_edge_weight * edge_mask(shape_mask(images[idx], [captions_attrs[i] for i in idx]))
            rec = (w * ((y - x) ** 2 + 0.5 * (y - x).abs())).mean() / w.mean()
        kl = post.kl().mean() / z[0].numel()
        loss = rec + args.vae_kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        run_loss += rec.item()
        run_kl += kl.item()
        if (step + 1) % args.log_every == 0:
            log(f"vae step {step + 1}/{args.vae_steps} rec {run_loss / args.log_every:.5f} "
                f"kl/elem {run_kl / args.log_every:.3f} ({time.time() - t0:.0f}s)")
            run_loss = run_kl = 0.0
        if budget.over():
            log(f"vae: time budget reached after {step + 1} steps")
            break
    vae.eval()
    # reconstruction check on held-out images, f32 and bf16 decode
    with torch.no_grad():
        z = vae.encode(held_out).latent_dist.mean
        rec32 = vae.decode(z).sample
        vae16 = copy.deepcopy(vae).to(torch.bfloat16)
        rec16 = vae16.decode(z.to(torch.bfloat16)).sample.float()
    for name, rec in (("f32", rec32), ("bf16", rec16)):
        mse = F.mse_loss(rec.clamp(-1, 1), held_out).item()
        psnr = 10 * math.log10(4.0 / max(mse, 1e-12))
        u8 = to_uint8(rec)
        ok = np.mean([shapes.check(u8[i], captions_attrs[n_train + i])["ok"] for i in range(len(u8))])
        log(f"vae held-out reconstruction {name}: PSNR {psnr:.2f} dB, prompt check on reconstructions {ok:.3f}")
    log(f"vae trained in {time.time() - t0:.0f}s")
    return vae


def encode_latents(vae: AutoencoderKL, images: np.ndarray, batch: int = 256) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for i in range(0, len(images), batch):
            out.append(vae.encode(to_pixels(images[i : i + batch])).latent_dist.mean)
    return torch.cat(out)


def tokenize(captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """CLIP ids (N, 77) and T5 ids (N, MAX_SEQUENCE_LENGTH), padded exactly as FluxPipeline pads them."""
    clip_tok = CLIPTokenizer.from_pretrained(ORACLE_TOKENIZERS / "clip")
    t5_tok = T5TokenizerFast.from_pretrained(ORACLE_TOKENIZERS / "t5")
    clip_ids = clip_tok(captions, padding="max_length", max_length=CLIP_LENGTH, truncation=True,
                        return_tensors="pt").input_ids
    t5_ids = t5_tok(captions, padding="max_length", max_length=MAX_SEQUENCE_LENGTH, truncation=True,
                    return_tensors="pt").input_ids
    return clip_ids, t5_ids


def shape_weights(images: np.ndarray, attrs: list[dict], factor: int, weight: float,
                  edge_weight: float) -> torch.Tensor:
    """Per-latent-pixel loss weights (N, 1, H/f, W/f): 1 + weight x the fraction of shape pixels + edge_weight x
    the fraction of outline pixels under each latent pixel.

    A small shape covers a few % of the image, so an unweighted loss is dominated by the plain background; this
    focuses the flow objective on the part the caption is mostly about, and on the outline that tells the shapes
    apart."""
    shape = shape_mask(images, attrs)
    return 1.0 + weight * F.avg_pool2d(shape, factor) + edge_weight * F.avg_pool2d(edge_mask(shape), factor)


def zero_init_modulation(transformer: FluxTransformer2DModel) -> None:
    """adaLN-Zero (as in DiT): every block starts as the identity and the output as zero."""
    with torch.no_grad():
        for name, module in transformer.named_modules():
            if isinstance(module, torch.nn.Linear) and (
                (".norm" in name and name.endswith(".linear")) or name in ("norm_out.linear", "proj_out")
            ):
                module.weight.zero_()
                module.bias.zero_()


def sample_sigmas(batch: int, gen: torch.Generator) -> torch.Tensor:
    """70 % uniform(0,1); 30 % the sigmas a 4- or 8-step schnell schedule (linspace(1, 1/N, N)) visits."""
    uniform = torch.rand(batch, generator=gen)
    grid = torch.cat([torch.linspace(1, 1 / 4, 4), torch.linspace(1, 1 / 8, 8)])
    on_grid = grid[torch.randint(0, len(grid), (batch,), generator=gen)]
    pick = torch.rand(batch, generator=gen) < 0.3
    return torch.where(pick, on_grid, uniform)


def train_transformer(args, latents: torch.Tensor, weights: torch.Tensor, clip_ids: torch.Tensor,
                      t5_ids: torch.Tensor, caption_index: torch.Tensor, clip: CLIPTextModel, t5: T5EncoderModel):
    torch.manual_seed(args.seed + 20)
    if args.resume_flow is not None:  # continue from a saved folder (its EMA weights, stored in bf16)
        transformer = FluxTransformer2DModel.from_pretrained(args.resume_flow / "transformer", dtype=torch.float32)
        t5 = T5EncoderModel.from_pretrained(args.resume_flow / "text_encoder_2", dtype=torch.float32)
        clip = CLIPTextModel.from_pretrained(args.resume_flow / "text_encoder", dtype=torch.float32)
        log(f"flow: resuming from {args.resume_flow}")
    else:
        transformer = FluxTransformer2DModel(**TRANSFORMER_CONFIG)
        zero_init_modulation(transformer)
    t5.train()
    if args.train_clip:
        # CLIP: its layers are trained (its pooled output is the global conditioning of every block, and its
        # causal attention sees word order); its 49408-row token table stays as initialised.
        clip.train()
        for name, module in clip.named_modules():
            if name.endswith("token_embedding"):
                module.requires_grad_(False)
        clip_pooled = None
        trained = (transformer, t5, clip)
    else:  # frozen: pooled features computed once by the bf16 encoder that ships (stages 1-2 of the model)
        clip.eval().requires_grad_(False)
        with torch.no_grad():
            clip_pooled = copy.deepcopy(clip).to(torch.bfloat16)(clip_ids).pooler_output.float()
        trained = (transformer, t5)
    params = [p for m in trained for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.dit_lr, weight_decay=0.0, betas=(0.9, 0.99))
    ema_t = copy.deepcopy(transformer).requires_grad_(False)
    ema_e = copy.deepcopy(t5).requires_grad_(False)
    ema_c = copy.deepcopy(clip).requires_grad_(False)
    gen = torch.Generator("cpu").manual_seed(args.seed + 21 + (args.resume_flow is not None))
    n, c, h, w = latents.shape
    img_ids = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)
    txt_ids = torch.zeros(MAX_SEQUENCE_LENGTH, 3)
    budget = Budget(args.max_minutes_dit)
    t0 = time.time()
    run = 0.0
    for step in range(args.dit_steps):
        lr = cosine_lr(step, args.dit_steps, args.dit_lr, 200)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, n, (args.dit_batch,), generator=gen)
        x0 = FluxPipeline._pack_latents(latents[idx], args.dit_batch, c, h, w)
        weight = FluxPipeline._pack_latents(weights[idx].expand(-1, c, -1, -1), args.dit_batch, c, h, w)
        cap = caption_index[idx]
        noise = torch.randn(x0.shape, generator=gen)
        sigma = sample_sigmas(args.dit_batch, gen)
        s = sigma[:, None, None]
        x_t = (1 - s) * x0 + s * noise  # FluxPipeline's Euler sampler integrates dx/dsigma = noise - x0
        text = t5(t5_ids[cap]).last_hidden_state
        pooled = clip(clip_ids[cap]).pooler_output if clip_pooled is None else clip_pooled[cap]
        v = transformer(hidden_states=x_t, timestep=sigma, guidance=None, pooled_projections=pooled,
                        encoder_hidden_states=text, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        if args.shape_weight == 0 and args.edge_weight == 0:
            loss = F.mse_loss(v, noise - x0)
        else:
            loss = (weight * (v - (noise - x0)) ** 2).mean() / weight.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(args.ema, (step + 1) / (step + 10))
        with torch.no_grad():
            for src, dst in zip(trained, (ema_t, ema_e, ema_c)):
                for p, q in zip(src.parameters(), dst.parameters()):
                    q.lerp_(p, 1 - decay)
        run += loss.item()
        if (step + 1) % args.log_every == 0:
            log(f"flow step {step + 1}/{args.dit_steps} loss {run / args.log_every:.4f} lr {lr:.2e} "
                f"({time.time() - t0:.0f}s)")
            run = 0.0
        if budget.over():
            log(f"flow: time budget reached after {step + 1} steps")
            break
    log(f"transformer trained in {time.time() - t0:.0f}s")
    return ema_t.eval(), ema_e.eval(), ema_c.eval()


# ---------------------------------------------------------------------------------------------------------


def prefix_clip_keys(path: Path) -> None:
    """Real FLUX.1 repos store CLIPTextModel keys as text_model.*; transformers 5 saves them without the
    prefix (it loads both). Rewrite to the real layout, as the oracle pipelines do."""
    tensors = load_file(path)
    renamed = {(k if k.startswith("text_model.") else "text_model." + k): v for k, v in tensors.items()}
    save_file(renamed, path, metadata={"format": "pt"})


def save_pipeline(out: Path, vae, clip, t5, transformer) -> None:
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    clip_tok = CLIPTokenizer.from_pretrained(ORACLE_TOKENIZERS / "clip")
    t5_tok = T5TokenizerFast.from_pretrained(ORACLE_TOKENIZERS / "t5")
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5,
                        tokenizer_2=t5_tok, transformer=transformer)
    pipe.to(torch.bfloat16)
    if out.exists():
        shutil.rmtree(out)
    pipe.save_pretrained(out, safe_serialization=True)
    # hand-written tokenizer folders (FLUX layout: CLIP without tokenizer.json), as in the oracle pipelines
    for folder, src in (("tokenizer", "clip"), ("tokenizer_2", "t5")):
        shutil.rmtree(out / folder)
        shutil.copytree(ORACLE_TOKENIZERS / src, out / folder)
        for f in (out / folder).iterdir():
            f.chmod(0o644)
        (out / folder).chmod(0o755)
    index = json.loads((out / "model_index.json").read_text())
    index["tokenizer_2"] = ["transformers", "T5TokenizerFast"]  # name used by the real repos (alias in tf 5)
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    prefix_clip_keys(out / "text_encoder" / "model.safetensors")
    for f in out.rglob("*.safetensors"):
        f.chmod(0o644)
    for f in out.glob("*/config.json"):  # from_pretrained (--resume-flow) records the source path: drop it
        config = json.loads(f.read_text())
        if config.pop("_name_or_path", None) is not None:
            f.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    defaults = {
        "height": HEIGHT,
        "width": WIDTH,
        "num_inference_steps": DEFAULT_STEPS,
        "guidance_scale": 0.0,
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
    }
    (out / "kiln_defaults.json").write_text(json.dumps(defaults, indent=2) + "\n")
    (out / "eval.json").write_text(json.dumps(shapes.eval_spec(), indent=2) + "\n")


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "assets" / "tiny-flux")
    ap.add_argument("--work", type=Path, default=Path("/tmp/tiny_flux_work"), help="cache of the trained VAE")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="1 is faster when the 2 cores are shared")
    ap.add_argument("--n-images", type=int, default=24000)
    ap.add_argument("--layout", choices=("fixed", "exact", "open"), default="fixed",
                    help="data layout (shapes.sample); the shipped model: stage 4 'open', 5-6 'fixed', 7-8 'exact'")
    ap.add_argument("--vae-steps", type=int, default=1000)
    ap.add_argument("--vae-batch", type=int, default=32)
    ap.add_argument("--vae-lr", type=float, default=2e-3)
    ap.add_argument("--vae-kl", type=float, default=1e-4, help="weight of the KL term (per latent element)")
    ap.add_argument("--reuse-vae", action="store_true", help="load --work/vae if it exists instead of training")
    ap.add_argument("--vae-init", type=Path, default=None, help="fine-tune this saved VAE folder instead of a new one")
    ap.add_argument("--vae-edge-weight", type=float, default=4.0, help="extra reconstruction weight on outlines")
    ap.add_argument("--dit-steps", type=int, default=3000)
    ap.add_argument("--dit-batch", type=int, default=32)
    ap.add_argument("--dit-lr", type=float, default=7e-4)
    ap.add_argument("--resume-flow", type=Path, default=None,
                    help="start the transformer and T5 from this saved folder (second training stage)")
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--shape-weight", type=float, default=8.0, help="extra loss weight on shape pixels")
    ap.add_argument("--edge-weight", type=float, default=0.0, help="extra flow loss weight on outline pixels")
    ap.add_argument("--train-clip", action=argparse.BooleanOptionalAction, default=True,
                    help="train CLIP's layers with the transformer (its token table stays fixed)")
    ap.add_argument("--max-minutes-vae", type=float, default=None, help="stop VAE training early (not reproducible)")
    ap.add_argument("--max-minutes-dit", type=float, default=None, help="stop flow training early (not reproducible)")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--skip-eval", action="store_true")
    args = ap.parse_args()

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    log(f"args {vars(args)}")

    images, captions_attrs, captions = [], [], []
    rng = np.random.default_rng(args.seed)
    for _ in range(args.n_images):
        img, text, attrs = shapes.sample(rng, args.layout)
        images.append(img)
        captions.append(text)
        captions_attrs.append(attrs)
    images = np.stack(images)
    log(f"data: {len(images)} images, {len(set(captions))} distinct captions")

    vae_dir = args.work / "vae"
    if args.reuse_vae and vae_dir.exists():
        vae = AutoencoderKL.from_pretrained(vae_dir, torch_dtype=torch.float32)
        log(f"vae loaded from {vae_dir}")
    else:
        vae = train_vae(args, images, captions_attrs)
        vae.save_pretrained(vae_dir)
    t_vae = time.time()

    latents = encode_latents(vae, images)
    mean, std = latents.mean().item(), latents.std().item()
    vae.register_to_config(shift_factor=round(mean, 4), scaling_factor=round(1.0 / std, 4))
    # FluxPipeline decodes latents / scaling_factor + shift_factor; the flow model sees the inverse
    latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
    log(f"latents {tuple(latents.shape)} mean {mean:.4f} std {std:.4f} -> shift_factor "
        f"{vae.config.shift_factor} scaling_factor {vae.config.scaling_factor}")

    unique = sorted(set(captions))
    lookup = {c: i for i, c in enumerate(unique)}
    caption_index = torch.tensor([lookup[c] for c in captions])
    clip_ids, t5_ids = tokenize(unique)
    n_t5_tokens = int((t5_ids != 0).sum(1).max())
    log(f"longest caption: {n_t5_tokens} T5 tokens (max_sequence_length {MAX_SEQUENCE_LENGTH})")

    clip = CLIPTextModel(CLIPTextConfig(**CLIP_CONFIG))
    reinit_random(clip, args.seed + 30)
    t5 = T5EncoderModel(T5Config(**T5_CONFIG))
    reinit_random(t5, args.seed + 31)
    factor = images.shape[1] // latents.shape[2]
    weights = shape_weights(images, captions_attrs, factor, args.shape_weight, args.edge_weight)
    log(f"shape-weighted loss: weight 1 + {args.shape_weight} x shape fraction + {args.edge_weight} x outline "
        f"fraction, mean {weights.mean():.3f}")

    transformer, t5, clip = train_transformer(args, latents, weights, clip_ids, t5_ids, caption_index, clip, t5)
    t_dit = time.time()

    save_pipeline(args.out, vae, clip, t5, transformer)
    size = folder_bytes(args.out)
    log(f"saved {args.out}: {size / 1e6:.2f} MB")
    timing = {
        "vae_s": round(t_vae - t_start),
        "flow_s": round(t_dit - t_vae),
        "total_train_s": round(t_dit - t_start),
    }
    log(f"timing {timing}")
    if not args.skip_eval:
        import eval_prompts

        eval_prompts.run(args.out, dtype="bf16", write_results=True)
    log(f"total wall time {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
