#!/usr/bin/env python3
"""kiln vs diffusers on one scaled FLUX.1 or SD3.5 model, eager and compiled, side by side in one run.

Builds (once) a pipeline with random weights and a scaled config, saves it with diffusers, then
times both engines on the same folder, prompt and steps, for each dtype (--dtypes) and square size
(--sizes), each engine and mode in its own process. --pipeline picks the model:

  flux: FluxPipeline, 2 double + 4 single blocks, width 512 (8 heads x 64), a small CLIP, T5 and
      VAE; guidance 3.5 is embedded (one transformer call per step). Folder target/bench_flux_model.
  sd3: StableDiffusion3Pipeline shaped like SD3.5 Medium: 4 MMDiT blocks of width 384 (6 heads x 64),
      the first 2 with dual attention, qk_norm rms_norm, patch 2, pos_embed_max_size 96; CLIP-L and
      CLIP-G with projection, T5, a 16-channel 4-level VAE (scaling 1.5305, shift 0.0609), scheduler
      shift 3.0. Guidance 7.0 is classifier-free guidance, so each step runs the transformer on a
      batch of 2 ([negative; prompt]), as diffusers does; at 512² a step then costs about what the
      scaled FLUX's does (64 against 60 GFLOP per step). Folder target/bench_sd3_model.
  flux_wide, sd3_wide: FLUX.1 and SD3.5 Medium at their real widths with few blocks (FLUX.1: 1 double + 2 single
      of 3072, 24 x 128 heads; SD3.5 Medium: 2 blocks of 1536, 24 x 64 heads), T5 at 4096 (one layer), the real
      VAE widths (128 to 512). Folders target/bench_flux_wide_model, target/bench_sd3_wide_model.
  zimage_wide: ZImagePipeline (Z-Image-Turbo) at its real widths with 2 main and 2 + 2 refiner layers of 3840,
      a 2-layer Qwen3 of width 2560, the real FLUX.1 VAE; guidance 0 (Turbo). Folder target/bench_zimage_wide_model.
  flux2: Flux2Pipeline (FLUX.2 [dev]) at the same scale: 2 double + 4 single blocks of width 512 (8 heads x 64),
      a 40-layer Mistral text model of width 256 read at layers 10, 20, 30, the 32-channel VAE at the scaled
      widths; guidance 4.0 is embedded. Folder target/bench_flux2_model.
  flux2_klein: Flux2KleinPipeline (FLUX.2 [klein] 4B, distilled): 1 double + 4 single blocks of width 512, a
      36-layer Qwen3 of width 256 read at layers 9, 18, 27, the same VAE; guidance 1.0 (distilled: none).
      Folder target/bench_flux2_klein_model.

  diffusers (--torch-modes): eager; regional = pipe.transformer.compile_repeated_blocks(fullgraph=True)
      (torch.compile of each repeated transformer block; FLUX only: diffusers 0.42.1's
      SD3Transformer2DModel declares no _repeated_blocks, so compile_repeated_blocks refuses it);
      full = pipe.transformer.compile(fullgraph=True).
      Every process compiles into a fresh empty TORCHINDUCTOR_CACHE_DIR (and TMPDIR, where inductor
      keeps precompiled headers), so its first call is a cold compile.
  kiln (--kiln-modes): `kiln bench --compile none|blocks|full`, each first with a fresh empty
      KILN_CACHE_DIR (cold start); blocks and full then run a second process on the now filled
      folder (warm start).

Per process: seconds per denoising step and end to end (medians of --runs calls after a first call),
the first call (for compiled modes this includes compiling), peak resident memory; torch.compile's
compile_s = first call - median end to end (both engines, cold process); kiln's warm start =
load + first call - median end to end of the warm process; kiln's time per op kind. --rounds repeats all processes, alternating engines; the tables
show medians over rounds. Then the goals: kiln eager (none) step <= 1.0x torch eager step; for each
compiled kiln mode, step <= 0.7x the best torch.compile step; FLUX also: cold compile_s <= 1/10 of
the best torch.compile compile_s, warm start <= 2 s. A mode that fails (or a process that crashes) is
reported with its error and NaNs; the run goes on.

Image agreement: in the first round every process saves the first image of its first call (seed 0), and
each is compared with torch eager's (max and mean |difference| in 0-255 levels): a benchmark of two
engines computing different images would be worthless.

    VENV/bin/python tools/bench_flux/bench.py --kiln target/release/kiln --sizes 512,1024 --out bench.json
    VENV/bin/python tools/bench_flux/bench.py --pipeline sd3 --kiln target/release/kiln --sizes 512,1024 --out sd3.json

Text encoder alone (--text-encoder-memory, FLUX.2 pipelines): each engine loads only the text encoder and encodes
the prompt once, one process each, per dtype and round: peak resident memory and time (diffusers loads every layer
of the encoder; kiln only those up to the last hidden state FLUX.2 reads).

    VENV/bin/python tools/bench_flux/bench.py --pipeline flux2 --text-encoder-memory --rounds 3

Offload comparison (--offload-modes none,model,sequential, instead of the compile comparison): kiln
`bench --offload none|model|sequential` (--offload-compile, default none) against diffusers with no offload,
`enable_model_cpu_offload()` and `enable_group_offload(onload_device, offload_device=cpu, offload_type="block_level",
num_blocks_per_group=1, use_stream=True)` (use_stream only where the device has streams: diffusers 0.42.1 refuses
streams on CPU). Per process: seconds per image and per step, peak device memory (kiln: its count of tensors on the
device; diffusers: torch.cuda.max_memory_allocated, none on CPU) and peak RSS. Goals: kiln model offload <= 1.10 x
kiln none end to end; kiln's peak device memory <= diffusers' in the same mode (where diffusers has a device count).

    VENV/bin/python tools/bench_flux/bench.py --kiln target/release/kiln --offload-modes none,model,sequential

VENV has tools/bench_flux/requirements.txt installed (torch, diffusers, transformers pinned);
torch.compile on CPU also needs a C++ compiler and the Python headers. One diffusers process alone:
    VENV/bin/python tools/bench_flux/bench.py --engine diffusers --torch-mode full --height 64 --width 64
"""
import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ORACLE_TOKENIZERS = REPO / "fixtures/oracle/tokenizers"
NAN = float("nan")
# Every result has these; NaN where a process failed or kiln gave null.
NUMBERS = ("load_s", "first_call_s", "compile_s", "step_s_median", "e2e_s_median", "peak_rss_mib", "peak_device_mib")
# kiln's offload modes and diffusers' counterparts.
OFFLOAD_MODES = {"none": "none", "model": "model", "sequential": "group"}


def build_flux(folder: Path, seed: int = 0, *, double: int = 2, single: int = 4, heads: int = 8, head_dim: int = 64,
               rope=(16, 24, 24), clip_width: int = 256, t5_width: int = 512, t5_ff: int = 1024,
               text_layers: int = 2, vae_widths=(64, 128, 256, 256)) -> None:
    """FluxPipeline with random weights; the defaults are the scaled FLUX.1 (2 + 4 blocks of 8 x 64), the
    keywords give other widths (build_flux_wide). CLIP and T5 have 64-wide heads."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=double, num_single_layers=single, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=t5_width, pooled_projection_dim=clip_width,
        guidance_embeds=True, axes_dims_rope=rope,
    )
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=clip_width, intermediate_size=4 * clip_width, num_hidden_layers=text_layers,
        num_attention_heads=clip_width // 64, max_position_embeddings=77, hidden_act="quick_gelu",
        projection_dim=clip_width, eos_token_id=2, bos_token_id=0, pad_token_id=1,
    ))
    t5 = T5EncoderModel(T5Config(
        vocab_size=32128, d_model=t5_width, d_kv=64, d_ff=t5_ff, num_layers=text_layers, num_heads=t5_width // 64,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
        relative_attention_max_distance=128, is_encoder_decoder=False,
    ))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=vae_widths,
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


def build_flux_wide(folder: Path, seed: int = 0) -> None:
    """FLUX.1 at its real widths with few blocks: 1 double + 2 single blocks of 3072 (24 heads x 128, RoPE axes
    16/56/56), T5 at 4096 (one layer, 64 heads x 64, d_ff 10240), CLIP-L's 768 (one layer), FLUX.1's VAE (128 to
    512 channels). Where the scaled model hides where the time goes at real sizes."""
    build_flux(folder, seed, double=1, single=2, heads=24, head_dim=128, rope=(16, 56, 56), clip_width=768,
               t5_width=4096, t5_ff=10240, text_layers=1, vae_widths=(128, 256, 512, 512))


def build_sd3(folder: Path, seed: int = 0, *, blocks: int = 4, heads: int = 6, dual=(0, 1), pos_embed_max_size: int = 96,
              clip_widths=(256, 384), t5_width: int = 768, t5_ff: int = 1536, text_layers: int = 2,
              vae_widths=(64, 128, 256, 256)) -> None:
    """SD3.5 Medium's layout (MMDiT with dual attention in the first half of the blocks, RMSNorm q/k,
    CLIP-L + CLIP-G with projection + T5, 16-channel VAE); the defaults are at the scaled FLUX.1's width scale,
    the keywords give other widths (build_sd3_wide). Heads are 64 wide."""
    import torch
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import (CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Config, T5EncoderModel,
                              T5TokenizerFast)

    torch.manual_seed(seed)
    clip_l_width, clip_g_width = clip_widths
    # SD3.5 Medium: 24 blocks of 24 x 64, dual attention in blocks 0-12, pos_embed_max_size 384 (patches);
    # by default 4 blocks of 6 x 64, dual in the first 2, and a 96 x 96 position table (1024² needs 64 x 64).
    transformer = SD3Transformer2DModel(
        sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=blocks, attention_head_dim=64,
        num_attention_heads=heads, caption_projection_dim=64 * heads, joint_attention_dim=t5_width,
        pooled_projection_dim=clip_l_width + clip_g_width, pos_embed_max_size=pos_embed_max_size,
        dual_attention_layers=dual, qk_norm="rms_norm",
    )

    def clip(width, act):
        # projection_dim = hidden_size as in SD3's CLIP-L and CLIP-G; eos_token_id 2 as in their configs.
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=49408, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=text_layers,
            num_attention_heads=width // 64, max_position_embeddings=77, hidden_act=act, projection_dim=width,
            eos_token_id=2, bos_token_id=0, pad_token_id=1,
        ))

    t5 = T5EncoderModel(T5Config(
        vocab_size=32128, d_model=t5_width, d_kv=64, d_ff=t5_ff, num_layers=text_layers, num_heads=t5_width // 64,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
        relative_attention_max_distance=128, is_encoder_decoder=False,
    ))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=vae_widths,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=2, norm_num_groups=32, scaling_factor=1.5305, shift_factor=0.0609,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=clip(clip_l_width, "quick_gelu"),
        tokenizer=CLIPTokenizer.from_pretrained(ORACLE_TOKENIZERS / "clip"),
        # SD3's CLIP-G tokenizer pads with "!" (id 0).
        text_encoder_2=clip(clip_g_width, "gelu"),
        tokenizer_2=CLIPTokenizer.from_pretrained(ORACLE_TOKENIZERS / "clip_pad_bang"),
        text_encoder_3=t5, tokenizer_3=T5TokenizerFast.from_pretrained(ORACLE_TOKENIZERS / "t5"),
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def build_sd3_wide(folder: Path, seed: int = 0) -> None:
    """SD3.5 Medium at its real widths with few blocks: 2 MMDiT blocks of 1536 (24 heads x 64), the first with
    dual attention, CLIP-L 768 and CLIP-G 1280 (one layer each), T5 at 4096 (one layer), SD3's VAE (128 to 512)."""
    build_sd3(folder, seed, blocks=2, heads=24, dual=(0,), pos_embed_max_size=384, clip_widths=(768, 1280),
              t5_width=4096, t5_ff=10240, text_layers=1, vae_widths=(128, 256, 512, 512))


def unpacked(folder: Path, into: Path) -> Path:
    """A copy of a fixture folder (symlinks followed) with its .xz files decompressed, as diffusers reads it."""
    import lzma
    import shutil

    for src in sorted(folder.rglob("*")):
        if src.is_dir():
            continue
        dst = into / src.relative_to(folder)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.suffix == ".xz":
            dst.with_suffix("").write_bytes(lzma.decompress(src.read_bytes()))
        else:
            shutil.copyfile(src, dst)
    return into


def flux2_transformer(double: int, single: int, text_width: int, guidance: bool):
    """Flux2Transformer2DModel at the scaled FLUX.1's width: 8 heads x 64 (real: 48 x 128 for [dev], 24 x 128 for
    [klein] 4B), the 4-axis RoPE split evenly, 128 input channels (32 latent channels x 2x2) as in the real ones."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1, in_channels=128, num_layers=double, num_single_layers=single, attention_head_dim=64,
        num_attention_heads=8, joint_attention_dim=3 * text_width, timestep_guidance_channels=256, mlp_ratio=3.0,
        axes_dims_rope=(16, 16, 16, 16), rope_theta=2000, eps=1e-6, guidance_embeds=guidance,
    )


def flux2_vae():
    """AutoencoderKLFlux2 with the scaled FLUX.1 VAE's widths (real: 128, 256, 512, 512): 32 latent channels,
    quant convs, BatchNorm statistics over the 2x2-patchified latents."""
    from diffusers import AutoencoderKLFlux2

    return AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(64, 128, 256, 256), layers_per_block=2,
        latent_channels=32, norm_num_groups=32, patch_size=(2, 2), use_quant_conv=True, use_post_quant_conv=True,
    )


def build_flux2(folder: Path, seed: int = 0) -> None:
    """FLUX.2 [dev]'s layout: Mistral3ForConditionalGeneration (the oracle's tiny vision tower; a 40-layer text
    model of width 256, 4 heads x 64, 2 KV heads, of which FLUX.2 reads layers 10, 20, 30), the oracle's Mistral
    tokenizer and chat template, a 2 + 4 block transformer with embedded guidance, the 32-channel VAE."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralProcessor

    oracle = REPO / "fixtures/oracle/pipelines/flux2_dev"
    torch.manual_seed(seed)
    config = Mistral3Config.from_pretrained(oracle / "text_encoder")
    text = config.text_config
    text.hidden_size, text.head_dim, text.num_attention_heads, text.num_key_value_heads = 256, 64, 4, 2
    text.intermediate_size, text.num_hidden_layers = 1024, 40
    with tempfile.TemporaryDirectory(prefix="bench_flux2_tokenizer_") as tmp:
        processor = PixtralProcessor.from_pretrained(unpacked(oracle / "tokenizer", Path(tmp)))
        pipe = Flux2Pipeline(
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(oracle / "scheduler"), vae=flux2_vae(),
            text_encoder=Mistral3ForConditionalGeneration(config), tokenizer=processor,
            transformer=flux2_transformer(2, 4, text.hidden_size, guidance=True),
        )
        pipe.save_pretrained(folder, safe_serialization=True)


def build_flux2_klein(folder: Path, seed: int = 0) -> None:
    """FLUX.2 [klein] 4B's layout (distilled): Qwen3ForCausalLM with 36 layers of width 256 (4 heads x 64, 2 KV
    heads, q/k RMSNorm, tied embeddings) of which klein reads layers 9, 18, 27, the oracle's Qwen3 tokenizer and
    chat template, a 1 + 4 block transformer without guidance embedding (real: 5 + 20), the 32-channel VAE."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    oracle = REPO / "fixtures/oracle/pipelines/flux2_klein"
    torch.manual_seed(seed)
    config = Qwen3Config.from_pretrained(oracle / "text_encoder")
    config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads = 256, 64, 4, 2
    config.intermediate_size, config.num_hidden_layers, config.max_window_layers = 1024, 36, 36
    config.layer_types = ["full_attention"] * 36
    with tempfile.TemporaryDirectory(prefix="bench_klein_tokenizer_") as tmp:
        tokenizer = AutoTokenizer.from_pretrained(unpacked(oracle / "tokenizer", Path(tmp)))
        pipe = Flux2KleinPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(oracle / "scheduler"), vae=flux2_vae(),
            text_encoder=Qwen3ForCausalLM(config), tokenizer=tokenizer,
            transformer=flux2_transformer(1, 4, config.hidden_size, guidance=False), is_distilled=True,
        )
        pipe.save_pretrained(folder, safe_serialization=True)


def build_zimage_wide(folder: Path, seed: int = 0) -> None:
    """Z-Image-Turbo at its real widths with few blocks: ZImageTransformer2DModel of dim 3840 (30 heads x 128,
    RoPE axes 32/48/48, caption features 2560) with 2 main layers and 2 + 2 refiner layers (real: 30 and 2 + 2);
    a Qwen3Model of width 2560 (32 heads x 128, 8 KV heads, intermediate 9728) with 2 layers (real: 36; Z-Image
    reads the second-to-last), the oracle's Qwen3 tokenizer; FLUX.1's VAE at its real widths (128 to 512).
    Turbo's setting: guidance 0 (no CFG)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    oracle = REPO / "fixtures/oracle/pipelines/zimage_turbo"
    torch.manual_seed(seed)
    config = Qwen3Config.from_pretrained(oracle / "text_encoder")
    config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads = 2560, 128, 32, 8
    config.intermediate_size, config.num_hidden_layers, config.max_window_layers = 9728, 2, 2
    config.layer_types = ["full_attention"] * 2
    transformer = ZImageTransformer2DModel(n_layers=2, n_refiner_layers=2, axes_lens=[1536, 512, 512])
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=2, norm_num_groups=32, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    with tempfile.TemporaryDirectory(prefix="bench_zimage_tokenizer_") as tmp:
        tokenizer = AutoTokenizer.from_pretrained(unpacked(oracle / "tokenizer", Path(tmp)))
        pipe = ZImagePipeline(
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(oracle / "scheduler"), vae=vae,
            text_encoder=Qwen3Model(config), tokenizer=tokenizer, transformer=transformer,
        )
        pipe.save_pretrained(folder, safe_serialization=True)


@dataclasses.dataclass(frozen=True)
class Spec:
    """What differs between the benchmarked pipelines."""
    class_name: str
    build: object
    folder: str
    title: str
    guidance: float
    torch_modes: str
    # FLUX's issue also set goals for kiln's compile time and warm start.
    compile_goals: bool
    note: str = ""
    # FLUX.2's issues also set: every kiln mode's end to end <= 1.0 x the best diffusers end to end.
    e2e_goal: bool = False


PIPELINES = {
    "flux": Spec("FluxPipeline", build_flux, "target/bench_flux_model",
                 "scaled FLUX.1 (2+4 blocks, width 512), guidance embedded", 3.5, "eager,regional,full", True),
    "sd3": Spec("StableDiffusion3Pipeline", build_sd3, "target/bench_sd3_model",
                "scaled SD3.5 Medium (4 MMDiT blocks, 2 dual, width 384), CFG: transformer batch 2", 7.0,
                "eager,full", False,
                "torch.compile regional is not run: diffusers 0.42.1's SD3Transformer2DModel has no "
                "_repeated_blocks, so compile_repeated_blocks raises."),
    "flux_wide": Spec("FluxPipeline", build_flux_wide, "target/bench_flux_wide_model",
                      "FLUX.1 at real widths (1+2 blocks of 3072, 24 x 128 heads, T5 4096, real VAE), guidance "
                      "embedded", 3.5, "eager,regional,full", False),
    "sd3_wide": Spec("StableDiffusion3Pipeline", build_sd3_wide, "target/bench_sd3_wide_model",
                     "SD3.5 Medium at real widths (2 MMDiT blocks of 1536, 1 dual, 24 x 64 heads, T5 4096, real VAE), "
                     "CFG: transformer batch 2", 7.0, "eager,full", False),
    "zimage_wide": Spec("ZImagePipeline", build_zimage_wide, "target/bench_zimage_wide_model",
                        "Z-Image-Turbo at real widths (2 + 2 + 2 layers of 3840, 30 x 128 heads, Qwen3 2560, real "
                        "VAE), guidance 0 (Turbo: no CFG)", 0.0, "eager,regional,full", False),
    "flux2": Spec("Flux2Pipeline", build_flux2, "target/bench_flux2_model",
                  "scaled FLUX.2 [dev] (2+4 blocks, width 512, 40-layer Mistral of width 256), guidance embedded",
                  4.0, "eager,regional,full", False, e2e_goal=True),
    "flux2_klein": Spec("Flux2KleinPipeline", build_flux2_klein, "target/bench_flux2_klein_model",
                        "scaled FLUX.2 [klein] distilled (1+4 blocks, width 512, 36-layer Qwen3 of width 256), "
                        "no guidance", 1.0, "eager,regional,full", False, e2e_goal=True),
}


def peak_rss_mib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_diffusers(args) -> dict:
    # Fresh inductor caches, set before torch is imported, so a compiled mode's first call is a cold compile.
    # Inductor keeps some (precompiled headers) in TMPDIR/torchinductor_USER whatever TORCHINDUCTOR_CACHE_DIR
    # says, so TMPDIR moves too, here and for its compile workers.
    with tempfile.TemporaryDirectory(prefix="bench_flux_inductor_", ignore_cleanup_errors=True) as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "cache")
        os.environ["TMPDIR"] = tempfile.tempdir = tmp
        return run_diffusers_in(args)


def run_diffusers_in(args) -> dict:
    import diffusers
    import torch

    torch.set_num_threads(args.threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    result = {"engine": "diffusers", "pipeline": PIPELINES[args.pipeline].class_name, "mode": args.torch_mode,
              "dtype": args.dtype, "height": args.height,
              "width": args.width, "steps": args.steps, "runs": args.runs, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "offload": args.torch_offload, **{k: NAN for k in NUMBERS}}
    t = time.perf_counter()
    pipe = getattr(diffusers, PIPELINES[args.pipeline].class_name).from_pretrained(args.model, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    # Offload moves weights between the CPU and the accelerator; on a CPU-only machine both are the
    # CPU (diffusers then offloads to and from the same memory).
    cuda = torch.cuda.is_available()
    onload = torch.device("cuda" if cuda else "cpu")
    if args.torch_offload == "model":
        pipe.enable_model_cpu_offload(device=onload)
    elif args.torch_offload == "group":
        result["use_stream"] = cuda
        pipe.enable_group_offload(onload_device=onload, offload_device=torch.device("cpu"), offload_type="block_level",
                                  num_blocks_per_group=1, use_stream=cuda)
    elif cuda:
        pipe.to(onload)
    result["load_s"] = time.perf_counter() - t
    step_times = []

    def call():
        marks = [time.perf_counter()]

        def on_step(p, i, ts, kw):
            marks.append(time.perf_counter())
            return kw

        t0 = time.perf_counter()
        out = pipe(prompt=args.prompt, height=args.height, width=args.width, num_inference_steps=args.steps,
                   guidance_scale=args.guidance, max_sequence_length=args.max_sequence_length,
                   generator=torch.Generator("cpu").manual_seed(0), callback_on_step_end=on_step)
        e2e = time.perf_counter() - t0
        # The first mark is the call start; the first step also contains text encoding.
        return e2e, [b - a for a, b in zip(marks[1:], marks[2:])], out.images[0]

    try:
        # torch.compile is lazy: these only wrap the modules, the first call compiles.
        if args.torch_mode == "regional":
            pipe.transformer.compile_repeated_blocks(fullgraph=True)
        elif args.torch_mode == "full":
            pipe.transformer.compile(fullgraph=True)
        with torch.inference_mode():
            t = time.perf_counter()
            _, _, image = call()
            result["first_call_s"] = time.perf_counter() - t
            if args.image:
                image.save(args.image)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            e2e = []
            for _ in range(args.runs):
                e, steps, _ = call()
                e2e.append(e)
                step_times.extend(steps)
    except Exception as e:
        # Inductor errors can be pages long (generated code, compiler command): keep the start.
        result["error"] = f"{type(e).__name__}: {e}"[:2000]
    else:
        result["step_s_median"] = statistics.median(step_times) if step_times else NAN
        result["e2e_s_median"] = statistics.median(e2e)
        if args.torch_mode != "eager":
            result["compile_s"] = result["first_call_s"] - result["e2e_s_median"]
    result["peak_rss_mib"] = peak_rss_mib()
    if cuda:
        result["peak_device_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def run_diffusers_text_encoder(args) -> dict:
    """The pipeline with only its text encoder (transformer=None, vae=None, as diffusers allows), loaded and
    the prompt encoded once with `encode_prompt`: the time and the peak resident memory."""
    import diffusers
    import torch

    torch.set_num_threads(args.threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    result = {"engine": "diffusers", "pipeline": PIPELINES[args.pipeline].class_name, "stage": "text_encoder",
              "dtype": args.dtype, "torch": torch.__version__, "threads": torch.get_num_threads()}
    t = time.perf_counter()
    pipe = getattr(diffusers, PIPELINES[args.pipeline].class_name).from_pretrained(
        args.model, transformer=None, vae=None, torch_dtype=dtype)
    result["load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    with torch.inference_mode():
        embeds = pipe.encode_prompt(prompt=args.prompt, max_sequence_length=args.max_sequence_length)[0]
    result["encode_s"] = time.perf_counter() - t
    result["prompt_embeds_shape"] = list(embeds.shape)
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def text_encoder_memory(args) -> None:
    """FLUX.2: each engine loads only the text encoder and encodes the prompt once, in its own process, per dtype
    and round; peak resident memory and time, medians over rounds."""
    rows = []
    for dtype in args.dtypes.split(","):
        for _ in range(args.rounds):
            common = ["--model", str(args.model), "--prompt", args.prompt, "--dtype", dtype,
                      "--max-sequence-length", str(args.max_sequence_length)]
            torch_cmd = [sys.executable, __file__, "--engine", "diffusers-text-encoder", "--pipeline", args.pipeline,
                         "--threads", str(args.threads), *common]
            kiln_cmd = [args.kiln, "bench", "--text-encoder-only", "--json", "--device", args.device, *common]
            for engine, cmd in (("diffusers", torch_cmd), ("kiln", kiln_cmd)):
                r = run_process(cmd, {})
                r.update(engine=engine, dtype=dtype)
                rows.append(r)
                print(f"{engine:9} text encoder {dtype:4}: " + (f"ERROR {r['error'][:200]}" if "error" in r else
                      f"peak {r['peak_rss_mib']:.0f} MiB, load {r['load_s']:.2f} s, encode {r['encode_s']:.2f} s"),
                      file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    spec = PIPELINES[args.pipeline]
    print(f"\n### text encoder alone, {spec.title}: load it and encode one prompt (text length "
          f"{args.max_sequence_length}), {args.rounds} round(s)\n")
    print("| engine | dtype | peak RSS MiB | open s | load + encode s | peak RSS / diffusers' | notes |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        by = {e: [r for r in rows if (r["engine"], r["dtype"]) == (e, dtype)] for e in ("diffusers", "kiln")}
        summary = {e: {k: med(r.get(k, NAN) for r in rs) for k in ("peak_rss_mib", "load_s", "encode_s")}
                   for e, rs in by.items()}
        for e, rs in by.items():
            row = summary[e]
            errors = "; ".join(sorted({r["error"] for r in rs if "error" in r}))[:200]
            print(f"| {'torch' if e == 'diffusers' else 'kiln'} | {dtype} | {fmt(row['peak_rss_mib'], 0)} | "
                  f"{fmt(row['load_s'], 2)} | {fmt(row['encode_s'], 2)} | "
                  f"{fmt(row['peak_rss_mib'] / summary['diffusers']['peak_rss_mib'], 2)} | {errors} |")
    print("\ndiffusers: from_pretrained(transformer=None, vae=None) (open s: loading the text encoder) + encode_prompt; "
          "kiln: bench --text-encoder-only (open s: parsing the folder and mapping the files; the text encoder's "
          "layers are read during load + encode, only those up to the last hidden state used).")


def run_process(cmd: list, env: dict) -> dict:
    """The last JSON line a process prints, or {"error": ...} when it fails without one."""
    out = subprocess.run(cmd, capture_output=True, text=True,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **env})
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode == 0 and lines:
        return json.loads(lines[-1])
    last = (out.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit status {out.returncode}: {last}"[:2000]}


def run_engine(engine: str, mode: str, args, dtype: str, size: int, cache_dir: str = "", start: str = "cold",
               image: str = "", offload: str = "none") -> dict:
    """One process of `engine` in `mode` with kiln's `offload` mode (diffusers' counterpart); kiln compiles into (or
    loads from) `cache_dir`. With `image`, the process saves the first image of its first call there."""
    common = ["--model", str(args.model), "--prompt", args.prompt, "--height", str(size), "--width", str(size),
              "--steps", str(args.steps), "--guidance", str(args.guidance),
              "--max-sequence-length", str(args.max_sequence_length), "--dtype", dtype, "--runs", str(args.runs)]
    if image:
        common += ["--image", image]
    t = time.perf_counter()
    if engine == "kiln":
        cmd = [args.kiln, "bench", *common, "--device", args.device, "--compile", mode, "--json"]
        if offload != "none":
            cmd += ["--offload", offload]
        r = run_process(cmd, {"KILN_CACHE_DIR": cache_dir})
    else:
        cmd = [sys.executable, __file__, "--engine", "diffusers", "--pipeline", args.pipeline, *common,
               "--torch-mode", mode, "--threads", str(args.threads)]
        if offload != "none":
            cmd += ["--torch-offload", OFFLOAD_MODES[offload]]
        r = run_process(cmd, {})
    r["process_s"] = time.perf_counter() - t
    for k in NUMBERS:
        if r.get(k) is None:
            r[k] = NAN
    # The keys the tables group by, as asked for (kiln reports its mode as "compile").
    r.update(engine=engine, mode=mode, dtype=dtype, height=size, width=size, start=start, offload=offload)
    return r


def med(values) -> float:
    """Median of the values that are not NaN; NaN if none is."""
    v = [x for x in values if not math.isnan(x)]
    return statistics.median(v) if v else NAN


def fmt(x: float, digits: int = 3) -> str:
    return "" if math.isnan(x) else f"{x:.{digits}f}"


def compare_images(path: str, reference: str) -> dict:
    """max and mean |difference| of two 8-bit RGB images, in levels; how varied the reference is."""
    import numpy as np
    from PIL import Image

    a, b = (np.asarray(Image.open(p).convert("RGB"), dtype=np.int16) for p in (path, reference))
    if a.shape != b.shape:
        return {"error": f"sizes differ: {a.shape} vs {b.shape}"}
    d = np.abs(a - b)
    return {"max_abs": int(d.max()), "mean_abs": float(d.mean()), "reference_std": float(b.std()),
            "reference_clipped": float(np.mean((b == 0) | (b == 255)))}


def summarize(rs: list) -> dict:
    """One table row from all processes of one engine and mode (all rounds, cold and warm)."""
    cold = [r for r in rs if r["start"] == "cold"]
    warm = [r for r in rs if r["start"] == "warm"]
    row = {k: med(r[k] for r in rs) for k in ("step_s_median", "e2e_s_median", "peak_rss_mib")}
    row["first_call_s"] = med(r["first_call_s"] for r in cold)
    # Both engines: what the first call costs beyond a steady call (compiling or loading programs).
    row["compile_s"] = med(r["first_call_s"] - r["e2e_s_median"] for r in cold)
    row["xla_compile_s"] = med(r["compile_s"] for r in cold) if rs[0]["engine"] == "kiln" else NAN
    # Ready to generate in a new process on a filled cache: load + (first call - steady call).
    row["warm_start_s"] = med(r["load_s"] + r["first_call_s"] - r["e2e_s_median"] for r in warm)
    row["errors"] = sorted({r["error"] for r in rs if "error" in r})
    # kiln: programs compiled and loaded from disk, by the last cold and the last warm process.
    row["programs"] = [(r["start"], r.get("programs_compiled"), r.get("programs_disk_loaded")) for r in cold[-1:] + warm[-1:]]
    return row


def report(results: list, args, dtype: str, size: int) -> None:
    """The markdown table, the goals and kiln's op profile for one dtype and size."""
    torch_modes, kiln_modes = args.torch_modes.split(","), args.kiln_modes.split(",")
    rows = {}
    for engine, modes in (("diffusers", torch_modes), ("kiln", kiln_modes)):
        for mode in modes:
            rs = [r for r in results if (r["engine"], r["mode"], r["dtype"], r["height"]) == (engine, mode, dtype, size)]
            if rs:
                rows[engine, mode] = summarize(rs)
    nan_row = {k: NAN for k in ("step_s_median", "compile_s")}
    eager = rows.get(("diffusers", "eager"), nan_row)["step_s_median"]
    compiled = {m: rows[("diffusers", m)] for m in ("full", "regional") if ("diffusers", m) in rows}
    # The reference column: torch.compile full, or regional where full failed.
    ref_mode = next((m for m, row in compiled.items() if not math.isnan(row["step_s_median"])), "full")
    ref = compiled.get(ref_mode, nan_row)["step_s_median"]

    spec = PIPELINES[args.pipeline]
    print(f"\n### {dtype}, {size}x{size}: {spec.title}, {args.steps} steps, guidance {args.guidance:g}, "
          f"text length {args.max_sequence_length}, {args.threads} torch threads, {args.rounds} round(s)\n")
    print(f"| engine | mode | s/step | end-to-end s | first call (cold) s | compile s | warm start s | "
          f"peak RSS MiB | step / torch eager | step / torch.compile {ref_mode} | notes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (engine, mode), row in rows.items():
        notes = "; ".join(row["errors"])[:300].replace("|", "/").replace("\n", " ")
        if engine == "kiln" and not row["errors"]:
            notes = ", ".join(f"{s}: {c} compiled, {d} from disk" for s, c, d in row["programs"] if c is not None)
            notes += f"; {fmt(row['xla_compile_s'], 2)} s in XLA's compiler (cold)"
        print(f"| {'torch' if engine == 'diffusers' else 'kiln'} | {mode} | {fmt(row['step_s_median'])} | "
              f"{fmt(row['e2e_s_median'])} | {fmt(row['first_call_s'], 2)} | {fmt(row['compile_s'], 2)} | "
              f"{fmt(row['warm_start_s'], 2)} | {fmt(row['peak_rss_mib'], 0)} | "
              f"{fmt(row['step_s_median'] / eager, 2)} | {fmt(row['step_s_median'] / ref, 2)} | {notes} |")
    print("\ncompile s: first call - median end to end, in a process with an empty cache (inductor's or kiln's). "
          "warm start: load + first call - median end to end, of a second kiln process on the filled cache.")
    if spec.note and "regional" not in torch_modes:
        print(spec.note)

    checks = [r for r in results if (r["dtype"], r["height"]) == (dtype, size) and "image_vs_torch_eager" in r]
    print(f"\nimage agreement, {dtype} {size}x{size}: the first image of each process's first call (seed 0) "
          "against torch eager's, in 0-255 levels (torch.compile's rows show how far two correct runs drift apart "
          "by rounding alone)")
    for r in checks:
        c = r["image_vs_torch_eager"]
        text = c.get("error") or (
            f"max |diff| {c['max_abs']}, mean |diff| {c['mean_abs']:.4f} (torch eager image: std "
            f"{c['reference_std']:.1f} levels, {100 * c['reference_clipped']:.1f} % of values at 0 or 255)")
        print(f"  {'torch' if r['engine'] == 'diffusers' else 'kiln'} {r['mode']}: {text}")
    if not checks:
        print("  none: needs torch eager and at least one other process in the first round")

    # The goals compare each compiled kiln mode with the best torch.compile mode for that number.
    def best(key, digits):
        """The smallest value of `key` over the torch.compile modes, and how to print it."""
        ok = [(row[key], m) for m, row in compiled.items() if not math.isnan(row[key])]
        if not ok:
            return NAN, "no torch.compile result"
        value, mode = min(ok)
        return value, f"{fmt(value, digits)} s, {mode}"

    (t_step, step_text), (t_compile, compile_text) = best("step_s_median", 3), best("compile_s", 2)
    kiln_compiled = [(m, rows["kiln", m]) for m in kiln_modes if m != "none" and ("kiln", m) in rows]
    kiln_eager = [("none", rows["kiln", "none"])] if ("kiln", "none") in rows else []
    goals = [
        (f"kiln eager step <= 1.0 x torch eager step ({fmt(eager)} s)", kiln_eager, "step_s_median", eager, 3),
        (f"compiled kiln step <= 0.7 x best torch.compile step ({step_text})", kiln_compiled, "step_s_median",
         0.7 * t_step, 3),
    ]
    if spec.compile_goals:
        goals += [
            (f"kiln cold compile <= 1/10 of best torch.compile compile ({compile_text})", kiln_compiled,
             "compile_s", t_compile / 10, 2),
            ("kiln warm start (load + first call - steady call) <= 2 s", kiln_compiled, "warm_start_s", 2.0, 2),
        ]
    if spec.e2e_goal:
        torch_e2e = [(row["e2e_s_median"], m) for (e, m), row in rows.items()
                     if e == "diffusers" and not math.isnan(row["e2e_s_median"])]
        best_e2e, best_mode = min(torch_e2e) if torch_e2e else (NAN, "none")
        goals.append((f"kiln end to end <= 1.0 x best diffusers end to end ({fmt(best_e2e)} s, {best_mode})",
                      kiln_eager + kiln_compiled, "e2e_s_median", best_e2e, 3))
    print(f"\ngoals, {dtype} {size}x{size}:")
    for i, (text, kiln_rows, key, limit, digits) in enumerate(goals, 1):
        verdicts = []
        for m, row in kiln_rows:
            v = row[key]
            verdict = "n/a" if math.isnan(v) or math.isnan(limit) else ("met" if v <= limit else "NOT met")
            verdicts.append(f"{m} {fmt(v, digits) + ' s' if not math.isnan(v) else 'failed'}: {verdict}")
        limit_text = "n/a" if math.isnan(limit) else f"{fmt(limit, digits)} s"
        print(f"  {i}. {text}, limit {limit_text}: {'; '.join(verdicts) or 'no such kiln mode was run'}")

    for mode in kiln_modes:
        ks = [r for r in results if (r["engine"], r["mode"], r["dtype"], r["height"]) == ("kiln", mode, dtype, size)
              and r.get("ops")]
        if ks:
            print(f"\nkiln {mode} {dtype} {size}x{size}: time per op kind (one profiled call, {ks[-1]['start']} start)")
            for o in ks[-1]["ops"][:12]:
                print(f"  {o['op']:<20} {o['calls']:5} calls {o['total_s']:8.3f} s {100 * o['share']:5.1f} %")


def report_offload(results: list, args, dtype: str, size: int) -> None:
    """The offload table and its goals for one dtype and size."""
    modes = args.offload_modes.split(",")
    rows = {}
    for engine in ("diffusers", "kiln"):
        for offload in modes:
            rs = [r for r in results if (r["engine"], r["offload"], r["dtype"], r["height"]) == (engine, offload, dtype, size)]
            if rs:
                row = {k: med(r[k] for r in rs) for k in ("step_s_median", "e2e_s_median", "peak_rss_mib", "peak_device_mib")}
                row["errors"] = sorted({r["error"] for r in rs if "error" in r})
                row["use_stream"] = any(r.get("use_stream") for r in rs)
                rows[engine, offload] = row
    print(f"\n### offload, {dtype}, {size}x{size}: scaled FLUX.1 (2+4 blocks, width 512), {args.steps} steps, "
          f"text length {args.max_sequence_length}, kiln --compile {args.offload_compile}, {args.rounds} round(s)\n")
    print("| engine | offload | s / image | s / step | peak device MiB | peak RSS MiB | s / image vs none | notes |")
    print("|---|---|---|---|---|---|---|---|")
    for (engine, offload), row in rows.items():
        none = rows.get((engine, "none"), {}).get("e2e_s_median", NAN)
        name = {"none": "none", "model": "enable_model_cpu_offload",
                "sequential": "enable_group_offload(block_level, 1 block" + (", use_stream)" if row["use_stream"] else ")")}
        label = name[offload] if engine == "diffusers" else offload
        notes = "; ".join(row["errors"])[:300].replace("|", "/").replace("\n", " ")
        if engine == "diffusers" and math.isnan(row["peak_device_mib"]) and not notes:
            notes = "no device count on CPU (host and device are the same RAM)"
        print(f"| {'torch' if engine == 'diffusers' else 'kiln'} | {label} | {fmt(row['e2e_s_median'])} | "
              f"{fmt(row['step_s_median'])} | {fmt(row['peak_device_mib'], 1)} | {fmt(row['peak_rss_mib'], 0)} | "
              f"{fmt(row['e2e_s_median'] / none, 2)} | {notes} |")
    print(f"\ngoals, offload {dtype} {size}x{size}:")
    k_none = rows.get(("kiln", "none"), {}).get("e2e_s_median", NAN)
    k_model = rows.get(("kiln", "model"), {}).get("e2e_s_median", NAN)
    ratio = k_model / k_none
    verdict = "n/a" if math.isnan(ratio) else ("met" if ratio <= 1.10 else "NOT met")
    print(f"  1. kiln model offload <= 1.10 x kiln none end to end: {fmt(ratio, 2)}: {verdict}")
    for offload in modes:
        k = rows.get(("kiln", offload), {}).get("peak_device_mib", NAN)
        t = rows.get(("diffusers", offload), {}).get("peak_device_mib", NAN)
        if math.isnan(t) or math.isnan(k):
            print(f"  2. {offload}: kiln peak device memory {fmt(k, 1) or 'n/a'} MiB <= diffusers': n/a (diffusers "
                  f"has no device count here; compare peak RSS)")
        else:
            verdict = "met" if k <= t else "NOT met"
            print(f"  2. {offload}: kiln peak device memory {fmt(k, 1)} MiB <= diffusers' {fmt(t, 1)} MiB: {verdict}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["both", "diffusers", "diffusers-text-encoder"], default="both",
                   help="diffusers: run one diffusers process (--torch-mode, --height, --width, --dtype) and print its "
                        "JSON; diffusers-text-encoder: one process that loads only the text encoder and encodes")
    p.add_argument("--text-encoder-memory", action="store_true",
                   help="FLUX.2: compare peak memory of loading the text encoder alone and encoding (both engines)")
    p.add_argument("--pipeline", choices=sorted(PIPELINES), default="flux",
                   help="the scaled model to build and time (default folder target/bench_<pipeline>_model)")
    p.add_argument("--model", type=Path, help="the model folder (built there when it has no model_index.json)")
    p.add_argument("--kiln", default=str(REPO / "target/release/kiln"))
    p.add_argument("--prompt", default="a photo of a cat holding a sign that says hello world")
    p.add_argument("--sizes", default="512", help="heights = widths to run, comma separated")
    p.add_argument("--height", type=int, default=512, help="with --engine diffusers")
    p.add_argument("--width", type=int, default=512, help="with --engine diffusers")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--guidance", type=float, help="default: FLUX 3.5 (embedded), SD3 7.0 (classifier-free), FLUX.2 [dev] 4.0 (embedded), [klein] 1.0")
    p.add_argument("--max-sequence-length", type=int, default=128)
    p.add_argument("--dtype", default="f32", help="with --engine diffusers")
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--torch-modes", help="default: FLUX eager,regional,full; SD3 eager,full (no regional, see above)")
    p.add_argument("--torch-mode", choices=["eager", "regional", "full"], default="eager", help="with --engine diffusers")
    p.add_argument("--kiln-modes", default="none,blocks,full")
    p.add_argument("--offload-modes", default="",
                   help="run the offload comparison instead: kiln offload modes (none,model,sequential) against diffusers' "
                        "no offload, enable_model_cpu_offload and enable_group_offload")
    p.add_argument("--offload-compile", default="none", help="kiln's --compile in the offload comparison")
    p.add_argument("--torch-offload", choices=["none", "model", "group"], default="none", help="with --engine diffusers")
    p.add_argument("--device", default="cpu", help="kiln's --device")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="alternate the engines this many times")
    p.add_argument("--out", type=Path, help="write all results as JSON (rewritten after each process)")
    p.add_argument("--image", help="with --engine diffusers: save the first image of the first call here")
    args = p.parse_args()
    spec = PIPELINES[args.pipeline]
    args.model = args.model or REPO / spec.folder
    args.guidance = spec.guidance if args.guidance is None else args.guidance
    args.torch_modes = args.torch_modes or spec.torch_modes

    if not set(args.torch_modes.split(",")) <= {"eager", "regional", "full"}:
        p.error(f"--torch-modes: {args.torch_modes}: modes are eager, regional, full")
    if not set(args.kiln_modes.split(",")) <= {"none", "blocks", "full"}:
        p.error(f"--kiln-modes: {args.kiln_modes}: modes are none, blocks, full")
    if args.offload_modes and not set(args.offload_modes.split(",")) <= set(OFFLOAD_MODES):
        p.error(f"--offload-modes: {args.offload_modes}: modes are none, model, sequential")
    if args.engine == "diffusers":
        print(json.dumps(run_diffusers(args)))
        return
    if args.engine == "diffusers-text-encoder":
        print(json.dumps(run_diffusers_text_encoder(args)))
        return
    if not (args.model / "model_index.json").is_file():
        print(f"building the scaled {spec.class_name} in {args.model}", file=sys.stderr)
        spec.build(args.model)
    with open(args.model / "model_index.json") as f:
        if json.load(f)["_class_name"] != spec.class_name:
            p.error(f"{args.model} is not a {spec.class_name} folder (--pipeline {args.pipeline})")
    if args.text_encoder_memory:
        if args.pipeline not in ("flux2", "flux2_klein"):
            p.error("--text-encoder-memory: FLUX.2 pipelines only (flux2, flux2_klein)")
        text_encoder_memory(args)
        return
    sizes, dtypes = [int(s) for s in args.sizes.split(",")], args.dtypes.split(",")
    results = []
    images = tempfile.TemporaryDirectory(prefix="bench_images_")

    def record(r):
        results.append(r)
        status = f"ERROR {r['error'][:200]}" if "error" in r else (
            f"step {r['step_s_median']:.3f} s, end to end {r['e2e_s_median']:.3f} s, peak {r['peak_rss_mib']:.0f} MiB, "
            f"load {r['load_s']:.2f} s, first call {r['first_call_s']:.2f} s")
        print(f"{r['engine']:9} {r['mode']:8} {r['start']:4} offload {r['offload']:10} {r['dtype']:4} {r['height']:4}: "
              f"{status} ({r['process_s']:.0f} s)", file=sys.stderr)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))

    if args.offload_modes:
        for size in sizes:
            for dtype in dtypes:
                for _ in range(args.rounds):
                    for offload in args.offload_modes.split(","):
                        record(run_engine("diffusers", "eager", args, dtype, size, offload=offload))
                        with tempfile.TemporaryDirectory(prefix="bench_flux_kiln_cache_") as cache:
                            record(run_engine("kiln", args.offload_compile, args, dtype, size, cache, offload=offload))
        for size in sizes:
            for dtype in dtypes:
                report_offload(results, args, dtype, size)
        return

    def image_of(engine, mode, dtype, size, round_):
        """Where the first round's process saves its first image; compared after the run."""
        return os.path.join(images.name, f"{engine}_{mode}_{dtype}_{size}.png") if round_ == 0 else ""

    t_run = time.perf_counter()
    for size in sizes:
        for dtype in dtypes:
            for round_ in range(args.rounds):
                for mode in args.torch_modes.split(","):
                    image = image_of("diffusers", mode, dtype, size, round_)
                    record(run_engine("diffusers", mode, args, dtype, size, image=image))
                for mode in args.kiln_modes.split(","):
                    with tempfile.TemporaryDirectory(prefix="bench_kiln_cache_") as cache:
                        image = image_of("kiln", mode, dtype, size, round_)
                        cold = run_engine("kiln", mode, args, dtype, size, cache, "cold", image)
                        record(cold)
                        if mode != "none" and "error" not in cold:
                            record(run_engine("kiln", mode, args, dtype, size, cache, "warm"))
            reference = image_of("diffusers", "eager", dtype, size, 0)
            for r in results:
                path = image_of(r["engine"], r["mode"], dtype, size, 0)
                if ((r["dtype"], r["height"], r["start"]) == (dtype, size, "cold")
                        and (r["engine"], r["mode"]) != ("diffusers", "eager") and "image_vs_torch_eager" not in r
                        and os.path.isfile(path) and os.path.isfile(reference)):
                    r["image_vs_torch_eager"] = compare_images(path, reference)
            if args.out:
                args.out.write_text(json.dumps(results, indent=1))
    print(f"all processes: {time.perf_counter() - t_run:.0f} s", file=sys.stderr)
    for size in sizes:
        for dtype in dtypes:
            report(results, args, dtype, size)
    images.cleanup()


if __name__ == "__main__":
    main()
