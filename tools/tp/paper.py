#!/usr/bin/env python3
"""On paper, from the published configs: what tensor parallelism gives FLUX.1-dev, SD3.5-large and
FLUX.2-dev at 1024x1024 — per-device weight bytes (bf16) at TP 1/2/4/8 under kiln's plans, the
all-reduces per transformer forward and their bytes, and a step-time estimate on H200s and TPU v6e;
then context parallelism (the sequence split over the devices: Ulysses, ring, and TP x SP mixes) the
same way: each device computes 1/(tp*sp) of the step; Ulysses moves q, k, v and the output by
all-to-all each attention layer ((P-1)/P of the device's part of each), ring passes k and v P-1 times
around, both on the device's share of the heads; TP's all-reduces then carry only the device's tokens.

The plans mirror kiln's (crates/kiln-models: `tp_plan()` of each model): colwise / rowwise /
packed splits of the attention and MLP projections, everything else replicated. The estimate is
compute/N at a sustained rate plus ring all-reduce time (2(N-1)/N of the bytes over one link
direction), with no overlap: a bound to compare measurements with, not a measurement.
"""

BF16 = 2


def linear(name, fan_in, fan_out, bias=True, style=None, tokens=0):
    """(name, params, split_params, tokens): split_params is what the plan divides by N; tokens
    is how many of the 1024^2 sequence's tokens the projection sees (0: one vector per image)."""
    w = fan_in * fan_out
    b = fan_out if bias else 0
    if style in ("colwise", "packed_colwise"):
        return (name, w + b, w + b, tokens)
    if style in ("rowwise", "packed_rowwise"):
        return (name, w + b, w, tokens)
    return (name, w + b, 0, tokens)


IMG, FLUX_TXT = 4096, 512  # 1024^2 through an 8x VAE and 2x2 patches; FLUX's text length


def double_stream(d, mlp, bias, ff_in_style, ff_in_width, txt):
    """One double-stream block's attention and MLP projections (image and text streams)."""
    p = []
    for tokens in (IMG, txt):
        p += [linear("qkv", d, d, bias, "colwise", tokens) for _ in range(3)]
        p += [linear("out", d, d, bias, "rowwise", tokens)]
        p += [linear("ff_in", d, ff_in_width, bias, ff_in_style, tokens), linear("ff_out", mlp, d, bias, "rowwise", tokens)]
    return p


def flux1_dev():
    d, mlp, heads = 3072, 4 * 3072, 24
    p = [linear("x_embedder", 64, d, tokens=IMG), linear("context_embedder", 4096, d, tokens=FLUX_TXT),
         linear("t1", 256, d), linear("t2", d, d), linear("g1", 256, d), linear("g2", d, d),
         linear("p1", 768, d), linear("p2", d, d), linear("norm_out", d, 2 * d), linear("proj_out", d, 64, tokens=IMG)]
    for _ in range(19):
        p += [linear("norm1", d, 6 * d), linear("norm1_context", d, 6 * d), ("norms", 4 * 128, 0, 0)]
        p += double_stream(d, mlp, True, "colwise", mlp, FLUX_TXT)
    seq = IMG + FLUX_TXT
    for _ in range(38):
        p += [linear("norm", d, 3 * d), ("norms", 2 * 128, 0, 0)]
        p += [linear("qkv", d, d, True, "colwise", seq) for _ in range(3)]
        p += [linear("proj_mlp", d, mlp, True, "colwise", seq), linear("proj_out", d + mlp, d, True, "packed_rowwise", seq)]
    reduces = [(IMG, d), (FLUX_TXT, d)] * 2 * 19 + [(seq, d)] * 38
    flops = matmul_flops(p) + attention_flops(57, seq, d)
    return dict(name="FLUX.1-dev transformer", width=d, params=p, heads=heads, reduces=reduces, batch=1, flops=flops)


def sd35_large():
    d, heads, layers = 38 * 64, 38, 38
    mlp, txt = 4 * d, 77 + 256
    p = [("pos_embed", 16 * 4 * d + d + 192 * 192 * d, 0, 0), linear("context_embedder", 4096, d, tokens=txt),
         linear("t1", 256, d), linear("t2", d, d), linear("p1", 2048, d), linear("p2", d, d),
         linear("norm_out", d, 2 * d), linear("proj_out", d, 2 * 2 * 16, tokens=IMG)]
    reduces = []
    for i in range(layers):
        last = i == layers - 1
        p += [linear("norm1", d, 6 * d), linear("norm1_context", d, (2 if last else 6) * d), ("norms", 4 * 64, 0, 0)]
        block = double_stream(d, mlp, True, "colwise", mlp, txt)
        if last:
            # context_pre_only: the text stream has q, k, v but no output projection or MLP
            block = block[:4 + 2] + block[6:9]
        p += block
        reduces += [(IMG, d), (IMG, d)] + ([] if last else [(txt, d), (txt, d)])
    # classifier-free guidance: both halves in one forward (batch 2)
    flops = 2 * (matmul_flops(p) + attention_flops(layers, IMG + txt, d))
    return dict(name="SD3.5-large transformer", width=d, params=p, heads=heads, reduces=reduces, batch=2, flops=flops)


def flux2_dev():
    d, heads, mlp = 48 * 128, 48, 3 * 48 * 128
    p = [linear("x_embedder", 128, d, False, tokens=IMG), linear("context_embedder", 3 * 5120, d, False, tokens=FLUX_TXT),
         linear("t1", 256, d, False), linear("t2", d, d, False), linear("g1", 256, d, False), linear("g2", d, d, False),
         linear("mod_img", d, 6 * d, False), linear("mod_txt", d, 6 * d, False), linear("mod_single", d, 3 * d, False),
         linear("norm_out", d, 2 * d, False), linear("proj_out", d, 128, False, tokens=IMG)]
    for _ in range(8):
        p += [("norms", 4 * 128, 0, 0)] + double_stream(d, mlp, False, "packed_colwise", 2 * mlp, FLUX_TXT)
    seq = IMG + FLUX_TXT
    for _ in range(48):
        p += [linear("to_qkv_mlp_proj", d, 3 * d + 2 * mlp, False, "packed_colwise", seq), ("norms", 2 * 128, 0, 0)]
        p += [linear("to_out", d + mlp, d, False, "packed_rowwise", seq)]
    reduces = [(IMG, d), (FLUX_TXT, d)] * 2 * 8 + [(seq, d)] * 48
    flops = matmul_flops(p) + attention_flops(56, seq, d)
    return dict(name="FLUX.2-dev transformer", width=d, params=p, heads=heads, reduces=reduces, batch=1, flops=flops)


def matmul_flops(params):
    return 2 * sum(n * t for _, n, _, t in params)


def attention_flops(layers, seq, width):
    return layers * 4 * seq * seq * width


def text_encoders():
    """(name, params, split, kv/heads) of the text encoders kiln shards."""
    out = []
    # T5-XXL encoder v1.1: d 4096, 24 layers, 64 heads x 64, gated FF 10240, vocab 32128 (replicated)
    d, ff, inner = 4096, 10240, 64 * 64
    layer_split = 4 * d * inner + 3 * d * ff
    out.append(("T5-XXL encoder (FLUX.1, SD3.5)", 32128 * d + 24 * (layer_split + 2 * d), 24 * layer_split, 64))
    # Mistral-Small-3.x language model, the 30 of 40 layers FLUX.2 reads; embedding replicated
    d, ff, q, kv = 5120, 32768, 32 * 128, 8 * 128
    layer_split = d * q + 2 * d * kv + q * d + 3 * d * ff
    out.append(("Mistral-Small-3 (FLUX.2, 30 of 40 layers)", 131072 * d + 30 * (layer_split + 2 * d), 30 * layer_split, 8))
    return out


H200 = dict(name="H200 (NVLink)", flops=790e12, link=450e9)
V6E = dict(name="TPU v6e (ICI)", flops=0.8 * 918e12, link=400e9)


def gib(n):
    return n / 2**30


def main():
    print("## Per-device weight bytes (bf16, GiB) and what the plans allow\n")
    print("| model | TP 1 | TP 2 | TP 4 | TP 8 |")
    print("|---|---|---|---|---|")
    models = [flux1_dev(), sd35_large(), flux2_dev()]
    for m in models:
        total = sum(p[1] for p in m["params"]) * BF16
        split = sum(p[2] for p in m["params"]) * BF16
        cells = []
        for n in (1, 2, 4, 8):
            if m["heads"] % n:
                cells.append(f"— ({m['heads']} heads)")
            else:
                cells.append(f"{gib(total - split + split / n):.1f}")
        print(f"| {m['name']} | " + " | ".join(cells) + " |")
    for name, total, split, kv in text_encoders():
        cells = [f"{gib((total - split + split / n) * BF16):.1f}" if kv % n == 0 else "—" for n in (1, 2, 4, 8)]
        print(f"| {name} | " + " | ".join(cells) + " |")

    print("\n## All-reduces per transformer forward at 1024x1024 (bf16) and the step on paper\n")
    print("| model | all-reduces | GiB per forward | TFLOP per step | " +
          " | ".join(f"{hw['name']} TP {n}" for hw in (H200, V6E) for n in (1, 2, 4, 8)) + " |")
    print("|---|---|---|---|" + "---|" * 8)
    for m in models:
        nbytes = sum(r * w for r, w in m["reduces"]) * m["batch"] * BF16
        cells = []
        for hw in (H200, V6E):
            for n in (1, 2, 4, 8):
                if m["heads"] % n:
                    cells.append("—")
                    continue
                compute = m["flops"] / n / hw["flops"]
                comm = 0 if n == 1 else 2 * (n - 1) / n * nbytes / hw["link"]
                cells.append(f"{compute + comm:.3f} s ({comm * 1e3:.0f} ms comm)")
        print(f"| {m['name']} | {len(m['reduces'])} | {gib(nbytes):.2f} | {m['flops'] / 1e12:.0f} | " + " | ".join(cells) + " |")

    context_parallel(models)


def attention_layers(m):
    """(layers, joint sequence length) of the model's attention."""
    return {"FLUX.1-dev transformer": (57, IMG + FLUX_TXT), "SD3.5-large transformer": (38, IMG + 77 + 256),
            "FLUX.2-dev transformer": (56, IMG + FLUX_TXT)}[m["name"]]


def context_parallel(models):
    """Step time on paper with the sequence split (ulysses u, ring r) beside tensor parallelism tp."""
    mixes = [(1, 2, 1), (1, 4, 1), (1, 8, 1), (1, 1, 2), (1, 1, 4), (1, 1, 8), (1, 2, 2), (1, 4, 2),
             (2, 2, 1), (2, 4, 1), (4, 2, 1)]
    print("\n## Context parallelism at 1024x1024 (bf16): the step on paper\n")
    print("Per device: weight GiB (TP splits them, the sequence axis does not), GiB sent per step (all-to-all / ring "
          "passes / TP all-reduces), and the step (compute + communication, no overlap; ring attention can hide its "
          "passes behind the blocks' compute, so its figure is an upper bound). kiln today: FLUX.1, FLUX.2 and SD3.5 run "
          "every mix whose head counts divide (SD3.5's 333 text tokens are odd: padded to the degree, the padding "
          "keys masked).\n")
    print("| model | tp x ulysses x ring | devices | weight GiB | GiB sent per step | "
          + " | ".join(f"{hw['name']} s / step (comm ms)" for hw in (H200, V6E)) + " |")
    print("|---|---|---|---|---|---|---|")
    for m in models:
        layers, seq = attention_layers(m)
        d, batch = m["width"], m["batch"]
        total = sum(p[1] for p in m["params"]) * BF16
        split = sum(p[2] for p in m["params"]) * BF16
        for tp, u, r in mixes:
            sp = u * r
            n = tp * sp
            heads = m["heads"] // tp if m["heads"] % tp == 0 else 0
            if not heads or heads % u:
                print(f"| {m['name']} | {tp} x {u} x {r} | {n} | — ({m['heads']} heads) | | | |")
                continue
            part = seq / sp * (d / tp) * batch * BF16  # one device's q (or k, v, output) per layer
            a2a = layers * 4 * part * (u - 1) / u  # Ulysses: q, k, v in, output back
            # ring: k and v, r-1 times; after Ulysses a device holds u times the tokens and 1/u of the heads
            ring = layers * 2 * part * (r - 1)
            reduce = sum(t * w for t, w in m["reduces"]) * batch * BF16 / sp
            tp_comm = 0 if tp == 1 else 2 * (tp - 1) / tp * reduce
            sent = a2a + ring + tp_comm
            cells = []
            for hw in (H200, V6E):
                compute = m["flops"] / n / hw["flops"]
                comm = sent / hw["link"]
                cells.append(f"{compute + comm:.3f} ({comm * 1e3:.0f})")
            weights = total - split + split / tp
            print(f"| {m['name']} | {tp} x {u} x {r} | {n} | {gib(weights):.1f} | {gib(sent):.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
