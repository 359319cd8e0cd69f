"""A FLUX.1-schnell diffusers folder written without diffusers: configs, tokenizers and weights.

The parameter names and shapes of each component are enumerated here from its config (the
diffusers/transformers names: FluxTransformer2DModel, CLIPTextModel, T5EncoderModel,
AutoencoderKL), and `check_against` compares that enumeration with the safetensors headers of an
existing folder (the test fixtures' tiny pipeline), so the full-size folder has the layout diffusers
and kiln load. Weights come from a source function: copied from another folder (`--small`), or
random on the GPU with torch (the full-size check). Standard library only, except the torch source.
"""
import json
import shutil
import struct
from pathlib import Path

# The real FLUX.1-schnell sizes (black-forest-labs/FLUX.1-schnell's configs).
FULL_SIZES = {
    "transformer": {
        "num_layers": 19, "num_single_layers": 38, "num_attention_heads": 24, "attention_head_dim": 128,
        "joint_attention_dim": 4096, "pooled_projection_dim": 768, "axes_dims_rope": [16, 56, 56],
        "in_channels": 64, "guidance_embeds": False,
    },
    "text_encoder": {  # CLIP ViT-L/14 text encoder
        "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
        "projection_dim": 768, "vocab_size": 49408, "max_position_embeddings": 77,
    },
    "text_encoder_2": {  # T5-v1.1-XXL encoder
        "d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "num_decoder_layers": 24,
        "vocab_size": 32128, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    },
    "vae": {
        "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "norm_num_groups": 32,
        "latent_channels": 16, "sample_size": 1024,
        "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    },
}

WEIGHT_FILES = {
    "transformer": "diffusion_pytorch_model.safetensors",
    "text_encoder": "model.safetensors",
    "text_encoder_2": "model.safetensors",
    "vae": "diffusion_pytorch_model.safetensors",
}


def _linear(out, name, rows, cols, bias=True):
    out.append((f"{name}.weight", [rows, cols]))
    if bias:
        out.append((f"{name}.bias", [rows]))


def _norm(out, name, n, bias=True):
    out.append((f"{name}.weight", [n]))
    if bias:
        out.append((f"{name}.bias", [n]))


def _conv(out, name, o, i, k):
    out.append((f"{name}.weight", [o, i, k, k]))
    out.append((f"{name}.bias", [o]))


def flux_transformer_params(c):
    inner = c["num_attention_heads"] * c["attention_head_dim"]
    d = c["attention_head_dim"]
    out_ch = (c.get("out_channels") or c["in_channels"]) * c.get("patch_size", 1) ** 2
    p = []
    _linear(p, "x_embedder", inner, c["in_channels"])
    _linear(p, "context_embedder", inner, c["joint_attention_dim"])
    _linear(p, "time_text_embed.timestep_embedder.linear_1", inner, 256)
    _linear(p, "time_text_embed.timestep_embedder.linear_2", inner, inner)
    if c.get("guidance_embeds"):
        _linear(p, "time_text_embed.guidance_embedder.linear_1", inner, 256)
        _linear(p, "time_text_embed.guidance_embedder.linear_2", inner, inner)
    _linear(p, "time_text_embed.text_embedder.linear_1", inner, c["pooled_projection_dim"])
    _linear(p, "time_text_embed.text_embedder.linear_2", inner, inner)
    for i in range(c["num_layers"]):
        b = f"transformer_blocks.{i}"
        _linear(p, f"{b}.norm1.linear", 6 * inner, inner)
        _linear(p, f"{b}.norm1_context.linear", 6 * inner, inner)
        for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
            _linear(p, f"{b}.attn.{n}", inner, inner)
        for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            _norm(p, f"{b}.attn.{n}", d, bias=False)
        for ff in ("ff", "ff_context"):
            _linear(p, f"{b}.{ff}.net.0.proj", 4 * inner, inner)
            _linear(p, f"{b}.{ff}.net.2", inner, 4 * inner)
    for i in range(c["num_single_layers"]):
        b = f"single_transformer_blocks.{i}"
        _linear(p, f"{b}.norm.linear", 3 * inner, inner)
        _linear(p, f"{b}.proj_mlp", 4 * inner, inner)
        _linear(p, f"{b}.proj_out", inner, 5 * inner)
        for n in ("to_q", "to_k", "to_v"):
            _linear(p, f"{b}.attn.{n}", inner, inner)
        for n in ("norm_q", "norm_k"):
            _norm(p, f"{b}.attn.{n}", d, bias=False)
    _linear(p, "norm_out.linear", 2 * inner, inner)
    _linear(p, "proj_out", out_ch, inner)
    return p


def clip_text_params(c):
    h, m = c["hidden_size"], c["intermediate_size"]
    p = [
        ("text_model.embeddings.token_embedding.weight", [c["vocab_size"], h]),
        ("text_model.embeddings.position_embedding.weight", [c["max_position_embeddings"], h]),
    ]
    for i in range(c["num_hidden_layers"]):
        b = f"text_model.encoder.layers.{i}"
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            _linear(p, f"{b}.self_attn.{n}", h, h)
        _norm(p, f"{b}.layer_norm1", h)
        _norm(p, f"{b}.layer_norm2", h)
        _linear(p, f"{b}.mlp.fc1", m, h)
        _linear(p, f"{b}.mlp.fc2", h, m)
    _norm(p, "text_model.final_layer_norm", h)
    return p


def t5_encoder_params(c):
    d, inner, f = c["d_model"], c["num_heads"] * c["d_kv"], c["d_ff"]
    p = [("shared.weight", [c["vocab_size"], d])]
    for i in range(c["num_layers"]):
        b = f"encoder.block.{i}.layer"
        for n in ("q", "k", "v"):
            _linear(p, f"{b}.0.SelfAttention.{n}", inner, d, bias=False)
        _linear(p, f"{b}.0.SelfAttention.o", d, inner, bias=False)
        if i == 0:
            p.append((f"{b}.0.SelfAttention.relative_attention_bias.weight",
                      [c["relative_attention_num_buckets"], c["num_heads"]]))
        _norm(p, f"{b}.0.layer_norm", d, bias=False)
        _linear(p, f"{b}.1.DenseReluDense.wi_0", f, d, bias=False)
        _linear(p, f"{b}.1.DenseReluDense.wi_1", f, d, bias=False)
        _linear(p, f"{b}.1.DenseReluDense.wo", d, f, bias=False)
        _norm(p, f"{b}.1.layer_norm", d, bias=False)
    _norm(p, "encoder.final_layer_norm", d, bias=False)
    return p


def _resnet(p, name, i, o):
    _norm(p, f"{name}.norm1", i)
    _conv(p, f"{name}.conv1", o, i, 3)
    _norm(p, f"{name}.norm2", o)
    _conv(p, f"{name}.conv2", o, o, 3)
    if i != o:
        _conv(p, f"{name}.conv_shortcut", o, i, 1)


def _mid_block(p, name, ch, attention):
    _resnet(p, f"{name}.resnets.0", ch, ch)
    if attention:
        a = f"{name}.attentions.0"
        _norm(p, f"{a}.group_norm", ch)
        for n in ("to_q", "to_k", "to_v", "to_out.0"):
            _linear(p, f"{a}.{n}", ch, ch)
    _resnet(p, f"{name}.resnets.1", ch, ch)


def vae_params(c):
    ch, lpb, lat = c["block_out_channels"], c["layers_per_block"], c["latent_channels"]
    attention = c.get("mid_block_add_attention", True)
    p = []
    _conv(p, "encoder.conv_in", ch[0], c.get("in_channels", 3), 3)
    for i, o in enumerate(ch):
        prev = ch[i - 1] if i > 0 else ch[0]
        for j in range(lpb):
            _resnet(p, f"encoder.down_blocks.{i}.resnets.{j}", prev if j == 0 else o, o)
        if i != len(ch) - 1:
            _conv(p, f"encoder.down_blocks.{i}.downsamplers.0.conv", o, o, 3)
    _mid_block(p, "encoder.mid_block", ch[-1], attention)
    _norm(p, "encoder.conv_norm_out", ch[-1])
    _conv(p, "encoder.conv_out", 2 * lat, ch[-1], 3)
    if c.get("use_quant_conv", True):
        _conv(p, "quant_conv", 2 * lat, 2 * lat, 1)
    if c.get("use_post_quant_conv", True):
        _conv(p, "post_quant_conv", lat, lat, 1)
    _conv(p, "decoder.conv_in", ch[-1], lat, 3)
    _mid_block(p, "decoder.mid_block", ch[-1], attention)
    rev = list(reversed(ch))
    for i, o in enumerate(rev):
        prev = rev[i - 1] if i > 0 else rev[0]
        for j in range(lpb + 1):
            _resnet(p, f"decoder.up_blocks.{i}.resnets.{j}", prev if j == 0 else o, o)
        if i != len(rev) - 1:
            _conv(p, f"decoder.up_blocks.{i}.upsamplers.0.conv", o, o, 3)
    _norm(p, "decoder.conv_norm_out", ch[0])
    _conv(p, "decoder.conv_out", c.get("out_channels", 3), ch[0], 3)
    return p


PARAMS = {
    "transformer": flux_transformer_params,
    "text_encoder": clip_text_params,
    "text_encoder_2": t5_encoder_params,
    "vae": vae_params,
}


def read_header(path: Path) -> dict:
    """The tensors of a safetensors file: name -> {dtype, shape, data_offsets}."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def check_against(folder: Path) -> list:
    """Differences between the enumerated parameters for `folder`'s configs and its files (empty: same)."""
    problems = []
    for comp, enumerate_params in PARAMS.items():
        config = json.loads((folder / comp / "config.json").read_text())
        want = {name: shape for name, shape in enumerate_params(config)}
        got = {name: t["shape"] for name, t in read_header(folder / comp / WEIGHT_FILES[comp]).items()}
        for name in sorted(set(want) | set(got)):
            if want.get(name) != got.get(name):
                problems.append(f"{comp}: {name}: enumerated {want.get(name)}, file {got.get(name)}")
    return problems


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor (the header first, from the known shapes)."""

    SIZES = {"BF16": 2, "F16": 2, "F32": 4}

    def __init__(self, path: Path, params: list, dtype: str):
        self.f = open(path, "wb")
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        self.expected = []
        for name, shape in params:
            n = self.SIZES[dtype]
            for d in shape:
                n *= d
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
            self.expected.append((name, n))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.f.write(struct.pack("<Q", len(raw)) + raw)
        self.next = 0

    def write(self, name: str, data) -> None:
        want_name, n = self.expected[self.next]
        if name != want_name or len(memoryview(data).cast("B")) != n:
            raise ValueError(f"{name}: {len(memoryview(data).cast('B'))} bytes, expected {want_name} with {n}")
        self.f.write(data)
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.expected):
            raise ValueError(f"{len(self.expected) - self.next} tensors not written")
        self.f.close()


def write_configs(template: Path, dst: Path, sizes: dict, dtype_name: str) -> None:
    """Copies `template`'s model_index, scheduler and tokenizers; its component configs with `sizes`."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    shutil.copy(template / "model_index.json", dst / "model_index.json")
    for d in ("scheduler", "tokenizer", "tokenizer_2"):
        shutil.copytree(template / d, dst / d)
    for comp in PARAMS:
        config = json.loads((template / comp / "config.json").read_text())
        config.update(sizes.get(comp, {}))
        if "dtype" in config:
            config["dtype"] = dtype_name
        (dst / comp).mkdir()
        (dst / comp / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def build(template: Path, dst: Path, sizes: dict, source, dtype: str) -> dict:
    """Writes a folder: configs from `template` with `sizes`, weights from `source(comp, name, shape)`
    (bytes of `dtype`). Returns the parameter count and bytes per component."""
    write_configs(template, dst, sizes, {"BF16": "bfloat16", "F32": "float32", "F16": "float16"}[dtype])
    stats = {}
    for comp, enumerate_params in PARAMS.items():
        params = enumerate_params(json.loads((dst / comp / "config.json").read_text()))
        w = SafetensorsWriter(dst / comp / WEIGHT_FILES[comp], params, dtype)
        count = 0
        for name, shape in params:
            w.write(name, source(comp, name, shape))
            n = 1
            for d in shape:
                n *= d
            count += n
        w.close()
        stats[comp] = {"parameters": count, "bytes": (dst / comp / WEIGHT_FILES[comp]).stat().st_size}
    return stats


def copy_source(folder: Path):
    """Weights read from another folder's files (same names and shapes)."""
    headers, files = {}, {}
    for comp, file in WEIGHT_FILES.items():
        path = folder / comp / file
        headers[comp] = read_header(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            files[comp] = (8 + n, path.read_bytes())

    def source(comp, name, shape):
        t = headers[comp][name]
        if t["shape"] != shape:
            raise ValueError(f"{comp}.{name}: {t['shape']} in {folder}, enumerated {shape}")
        start, data = files[comp]
        a, b = t["data_offsets"]
        return data[start + a:start + b]

    return source, {comp: h[next(iter(h))]["dtype"] for comp, h in headers.items()}


def std_of(name: str, shape: list) -> tuple:
    """The oracle's initialisation: (mean, std). Matrices, kernels, embeddings N(0, 1/fan_in);
    1-D norm weights 1 + N(0, 0.1^2); other 1-D (biases) N(0, 0.05^2)."""
    if len(shape) >= 2:
        fan_in = 1
        for d in shape[1:]:
            fan_in *= d
        return 0.0, fan_in ** -0.5
    if "norm" in name and name.endswith(".weight"):
        return 1.0, 0.1
    return 0.0, 0.05


def torch_random_source(device: str = "cuda", seed: int = 0):
    """Random bf16 weights made on `device` with torch (fast for the full-size model)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)

    def source(comp, name, shape):
        mean, std = std_of(name, shape)
        t = torch.randn(shape, device=device, dtype=torch.float32, generator=g).mul_(std).add_(mean)
        return t.to(torch.bfloat16).contiguous().view(torch.uint8).cpu().numpy().data

    return source
