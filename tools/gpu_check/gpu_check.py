#!/usr/bin/env python3
"""The driver of scripts/gpu-check (read that script's header for the plan and the time budget).

Standard library only, so `--small` runs anywhere; torch is imported by the subprocesses that need it
(the full-size folder builder, the diffusers worker). Every phase runs in its own process with a
timeout inside one overall deadline; a phase that fails or runs out of time is recorded with its
error and the rest go on; the report is always written.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import folder as folder_mod  # noqa: E402

sys.path.insert(0, str(REPO / "tools" / "fixtures"))
import oracle_pack  # noqa: E402

PROMPT = "a photo of a cat holding a sign that says hello world"
# Reference figures of the issue, for the full-size run.
REFERENCE = {
    "physical_limit_e2e_s": 0.40,
    "flops_per_step_tflop": 74,
    "h200_bf16_tflops": 790,
    "diffusers_torch_compile_h100_e2e_s": 0.775,
    "goal_e2e_s": 0.50,
}


# ---------------------------------------------------------------- small helpers

class Log:
    def __init__(self, path: Path):
        self.f = open(path, "w", buffering=1)
        self.t0 = time.time()

    def __call__(self, msg: str) -> None:
        line = f"[{time.time() - self.t0:7.1f} s] {msg}"
        print(line, flush=True)
        self.f.write(line + "\n")


def run(log: Log, name: str, cmd: list, timeout: float, env: dict | None = None, cwd=None, full=False) -> dict:
    """Runs `cmd`, logging its output; returns rc, seconds and the output's tail (all of it if `full`)."""
    log(f"{name}: {' '.join(str(c) for c in cmd)} (timeout {timeout:.0f} s)")
    t = time.time()
    try:
        p = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, timeout=max(timeout, 1),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        out, rc = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    except OSError as e:
        out, rc = str(e), "error"
    seconds = time.time() - t
    log.f.write(out if out.endswith("\n") else out + "\n")
    log(f"{name}: rc {rc} after {seconds:.1f} s")
    return {"rc": rc, "seconds": round(seconds, 2), "tail": out if full else out[-2500:]}


def read_png_rgb(path: Path):
    """(width, height, bytes) of an 8-bit RGB or RGBA PNG (non-interlaced), with the stdlib only."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, idat, ihdr = 8, b"", None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h, depth, color, _, _, interlace = ihdr
    if depth != 8 or color not in (2, 6) or interlace:
        raise ValueError(f"{path}: only 8-bit RGB/RGBA non-interlaced PNGs are read here")
    bpp = 3 if color == 2 else 4
    raw, stride = zlib.decompress(idat), w * bpp
    out, prev = bytearray(), bytearray(stride)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        out += line if bpp == 3 else bytes(v for k, v in enumerate(line) if k % 4 != 3)
        prev = line
    return w, h, bytes(out)


def image_delta(a: Path, b: Path) -> dict:
    try:
        wa, ha, pa = read_png_rgb(a)
        wb, hb, pb = read_png_rgb(b)
    except (OSError, ValueError, AssertionError) as e:
        return {"error": str(e)}
    if (wa, ha) != (wb, hb):
        return {"error": f"sizes differ: {wa}x{ha} and {wb}x{hb}"}
    diffs = [abs(x - y) for x, y in zip(pa, pb)]
    return {
        "max_abs": max(diffs),
        "mean_abs": round(sum(diffs) / len(diffs), 3),
        "differing_fraction": round(sum(1 for d in diffs if d) / len(diffs), 5),
    }


def median(v):
    v = sorted(v)
    return None if not v else (v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2)


# ---------------------------------------------------------------- the plugin and python

def find_cuda_plugin(python: str) -> dict:
    """The CUDA PJRT plugin of `python`'s jax-cuda13-pjrt (or -cuda12): its importable package first,
    else a glob of its site-packages for the plugin file names."""
    code = r"""
import glob, importlib, json, os, site, sys
found = {}
for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
    try:
        m = importlib.import_module(name)
    except Exception as e:
        continue
    for f in ("xla_cuda_plugin.so", "pjrt_c_api_gpu_plugin.so"):
        p = os.path.join(os.path.dirname(m.__file__), f)
        if os.path.isfile(p):
            found = {"path": p, "how": "import " + name}
            break
    if found:
        break
if not found:
    roots = site.getsitepackages() + [site.getusersitepackages()] + [p for p in sys.path if p.endswith("-packages")]
    for r in roots:
        for pat in ("jax_plugins/*/xla_cuda_plugin.so", "jax_plugins/*/pjrt_c_api_gpu_plugin.so"):
            hits = sorted(glob.glob(os.path.join(r, pat)), reverse=True)
            if hits:
                found = {"path": hits[0], "how": "glob " + r}
                break
        if found:
            break
versions = {}
for pkg in ("jax", "jaxlib", "jax-cuda13-pjrt", "jax-cuda13-plugin", "torch", "diffusers", "transformers"):
    try:
        import importlib.metadata as md
        versions[pkg] = md.version(pkg)
    except Exception:
        pass
print(json.dumps({"plugin": found, "versions": versions, "python": sys.version.split()[0], "executable": sys.executable}))
"""
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return {"plugin": {}, "error": str(e)}


def python_has(python: str, modules: str, env=None) -> bool:
    r = subprocess.run([python, "-c", f"import {modules}"], capture_output=True, env=env, timeout=120)
    return r.returncode == 0


# ---------------------------------------------------------------- JAX's cuDNN attention, the template

JAX_TEMPLATE = r"""
import os, sys
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax, jax.numpy as jnp
shape = (1, 2, 16, 64)   # BNTH, as kiln's selftest case "attention head 64 no mask bf16"
q = jnp.zeros(shape, jnp.bfloat16)
try:
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention
    f = lambda q, k, v: dot_product_attention(q, k, v, scale=0.125, qkv_layout="BNTH")
    text = jax.jit(f).lower(q, q, q).as_text()
except Exception as e:
    print("BNTH lowering failed, BTNH through jax.nn:", e, file=sys.stderr)
    t = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=0.125, implementation="cudnn")
    text = jax.jit(f).lower(t, t, t).as_text()
print(text)
"""


def custom_call_line(text: str) -> str | None:
    return next((line.strip() for line in text.splitlines() if "__cudnn$fmha" in line), None)


def backend_config_of(line: str) -> dict | None:
    """The backend_config JSON of a printed custom call."""
    key = 'backend_config = "'
    i = line.find(key)
    if i < 0:
        return None
    # MLIR string escapes: \" and \\ (kiln prints these), or two hex digits (\22 for a quote, as
    # MLIR's own printer, and so JAX's as_text(), writes them).
    j, s = i + len(key), []
    hexdigits = "0123456789abcdefABCDEF"
    while j < len(line) and line[j] != '"':
        if line[j] == "\\":
            if j + 2 < len(line) and line[j + 1] in hexdigits and line[j + 2] in hexdigits:
                s.append(chr(int(line[j + 1:j + 3], 16)))
                j += 3
                continue
            j += 1
        s.append(line[j])
        j += 1
    try:
        return json.loads("".join(s))
    except ValueError:
        return None


def compare_templates(kiln_line: str | None, jax_line: str | None) -> dict:
    out = {"kiln": kiln_line, "jax": jax_line}
    if not kiln_line or not jax_line:
        out["verdict"] = "not compared: " + ("kiln's" if not kiln_line else "jax's") + " custom call not captured"
        return out
    kc, jc = backend_config_of(kiln_line), backend_config_of(jax_line)

    def flat(d, prefix=""):
        items = {}
        for k, v in (d or {}).items():
            if isinstance(v, dict):
                items.update(flat(v, f"{prefix}{k}."))
            else:
                items[f"{prefix}{k}"] = v
        return items

    fk, fj = flat(kc), flat(jc)
    diffs = {k: {"kiln": fk.get(k), "jax": fj.get(k)} for k in sorted(set(fk) | set(fj)) if fk.get(k) != fj.get(k)}
    out["backend_config_differences"] = diffs
    attrs = lambda line: [a for a in ("api_version = 2", "operand_layouts", "result_layouts", "tensor<0xui8>") if a in line]
    out["verdict"] = "backend_config identical" if not diffs else f"{len(diffs)} backend_config fields differ"
    out["attributes"] = {"kiln": attrs(kiln_line), "jax": attrs(jax_line)}
    return out


# ---------------------------------------------------------------- diffusers, in its own process

def diffusers_worker(a) -> None:
    """Loads the folder with diffusers and times eager and torch.compile calls; writes JSON."""
    import torch
    from diffusers import FluxPipeline

    deadline = a.deadline
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[a.dtype]
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    result = {"engine": "diffusers", "torch": torch.__version__, "modes": {}}
    import diffusers
    result["diffusers"] = diffusers.__version__
    t = time.time()
    pipe = FluxPipeline.from_pretrained(a.model, torch_dtype=dtype).to(a.device)
    pipe.set_progress_bar_config(disable=True)
    result["load_s"] = time.time() - t

    def call():
        steps, last = [], [0.0]

        def on_step(p, i, ts, kw):
            sync()
            now = time.time()
            steps.append(now - last[0])
            last[0] = now
            return kw

        sync()
        t0 = time.time()
        last[0] = t0
        image = pipe(a.prompt, height=a.height, width=a.width, num_inference_steps=a.steps, guidance_scale=0.0,
                     max_sequence_length=a.max_sequence_length, generator=torch.Generator("cpu").manual_seed(a.seed),
                     callback_on_step_end=on_step).images[0]
        sync()
        return image, time.time() - t0, steps

    for mode in a.modes.split(","):
        entry = {}
        try:
            if mode == "torch.compile":
                if time.time() > deadline - a.compile_reserve:
                    raise TimeoutError(f"skipped: under {a.compile_reserve:.0f} s left for torch.compile")
                pipe.transformer.compile(fullgraph=True)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            calls = []
            for k in range(a.calls):
                image, total, steps = call()
                calls.append({"total_s": total, "steps_s": steps})
                if time.time() > deadline - 5 and k >= 1:
                    break
            image.save(Path(a.out) / f"diffusers-{mode.replace('torch.', '')}.png")
            entry = {"calls": calls}
            if cuda:
                entry["peak_device_bytes"] = torch.cuda.max_memory_allocated()
        except Exception as e:  # noqa: BLE001 - reported in the JSON
            entry["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        result["modes"][mode] = entry
        Path(a.result).write_text(json.dumps(result, indent=2))
    Path(a.result).write_text(json.dumps(result, indent=2))


# ---------------------------------------------------------------- the run

def summarize_kiln(path: Path) -> dict:
    try:
        t = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {"error": f"no timings: {e}"}
    calls = t["calls"]
    last = calls[-1]
    return {
        "s_per_step": median(last["steps_s"]),
        "e2e_s": min(c["total_s"] for c in calls[1:]) if len(calls) > 1 else last["total_s"],
        "first_call_s": calls[0]["total_s"],
        "first_call_compile_s": calls[0]["compile_s"],
        "programs_compiled": calls[0]["programs_compiled"],
        "peak_device_gib": t["peak_device_bytes"] / 2**30 if t.get("peak_device_bytes") else None,
        "calls": len(calls),
    }


def summarize_diffusers(result: dict, mode: str) -> dict:
    entry = result.get("modes", {}).get(mode, {})
    if "calls" not in entry:
        return {"error": entry.get("error", "did not run")}
    calls = entry["calls"]
    steady = calls[1:] or calls
    return {
        "s_per_step": median(calls[-1]["steps_s"]),
        "e2e_s": min(c["total_s"] for c in steady),
        "first_call_s": calls[0]["total_s"],
        "first_call_compile_s": calls[0]["total_s"] - min(c["total_s"] for c in steady) if len(calls) > 1 else None,
        "peak_device_gib": entry["peak_device_bytes"] / 2**30 if entry.get("peak_device_bytes") else None,
        "calls": len(calls),
    }


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def write_report(out: Path, report: dict) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    lines = [f"kiln gpu-check ({report['mode']}) on {report.get('device_name') or report['device']}, "
             f"{report['total_s']:.0f} s in all", ""]
    c = report["call"]
    lines.append(f"call: {c['height']}x{c['width']}, {c['steps']} steps, {c['dtype']}, seed {c['seed']}, "
                 f"prompt {c['prompt']!r}; folder {report.get('folder', {}).get('path')}")
    st = report.get("selftest", {})
    lines.append(f"selftest: {st.get('summary', st.get('error', 'not run'))}")
    for row in st.get("failed_rows", [])[:20]:
        lines.append(f"  FAIL {row}")
    lines += ["", f"{'engine':<10} {'mode':<14} {'s/step':>8} {'end to end s':>13} {'first call s':>13} "
              f"{'compile s':>10} {'peak GPU GiB':>13}  notes"]
    for r in report["timings"]:
        lines.append(f"{r['engine']:<10} {r['mode']:<14} {fmt(r.get('s_per_step')):>8} {fmt(r.get('e2e_s')):>13} "
                     f"{fmt(r.get('first_call_s'), 2):>13} {fmt(r.get('first_call_compile_s'), 2):>10} "
                     f"{fmt(r.get('peak_device_gib'), 1):>13}  {r.get('error', r.get('note', ''))}")
    if report["mode"] == "full":
        ref = report["reference"]
        lines += ["", f"reference: physical limit ~{ref['physical_limit_e2e_s']} s end to end "
                      f"({ref['flops_per_step_tflop']} TFLOP/step at ~{ref['h200_bf16_tflops']} TFLOP/s bf16); "
                      f"diffusers + torch.compile on an H100 {ref['diffusers_torch_compile_h100_e2e_s']} s; "
                      f"goal <= {ref['goal_e2e_s']} s: {report.get('goal', 'not measured')}"]
    lines += ["", "images (max |Δ| in 0..255 levels, mean |Δ|, fraction of values that differ):"]
    for name, d in report["images"].items():
        lines.append(f"  {name:<40} " + (d["error"] if "error" in d else
                                         f"max {d['max_abs']}, mean {d['mean_abs']}, {d['differing_fraction']:.3%}"))
    if report.get("diffusers_note"):
        lines.append(f"diffusers: {report['diffusers_note']}")
    if report.get("cudnn_template"):
        lines.append(f"cuDNN attention, kiln vs jax's lowering: {report['cudnn_template'].get('verdict')}")
    for check in report.get("checks", []):
        lines.append(f"check: {check}")
    (out / "report.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--kiln", default=os.environ.get("KILN_BIN"))
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-report")
    ap.add_argument("--python", default=os.environ.get("GPU_CHECK_PYTHON") or "python3")
    ap.add_argument("--wheels", default=os.environ.get("GPU_CHECK_WHEELS"))
    ap.add_argument("--work", default=os.environ.get("GPU_CHECK_WORK"))
    ap.add_argument("--oracle", default=None, help="oracle folder for the selftest's FLUX.1 case")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (full: 450)")
    ap.add_argument("--skip-diffusers", action="store_true")
    ap.add_argument("--reuse-folder", action="store_true", help="keep an already built full-size folder")
    ap.add_argument("--diffusers-worker", action="store_true", help=argparse.SUPPRESS)
    for k in ("model", "device", "dtype", "prompt", "modes", "result", "deadline", "compile_reserve", "height",
              "width", "steps", "seed", "max_sequence_length", "calls"):
        ap.add_argument(f"--w-{k.replace('_', '-')}", dest=f"w_{k}", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.diffusers_worker:
        w = argparse.Namespace(**{k[2:]: v for k, v in vars(a).items() if k.startswith("w_")}, out=a.out)
        for k in ("height", "width", "steps", "seed", "max_sequence_length", "calls"):
            setattr(w, k, int(getattr(w, k)))
        w.deadline, w.compile_reserve = float(w.deadline), float(w.compile_reserve)
        diffusers_worker(w)
        return 0

    start = time.time()
    small = a.small
    budget = a.budget or (300.0 if small else 450.0)
    deadline = start + budget
    left = lambda: deadline - time.time()  # noqa: E731
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in ("report.json", "report.txt"):
        (out / old).unlink(missing_ok=True)
    work = Path(a.work or tempfile.mkdtemp(prefix="kiln-gpu-check-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    log = Log(out / "gpu-check.log")
    kiln = a.kiln or next((str(p) for p in (REPO / "target/release/kiln", REPO / "target/debug/kiln") if p.is_file()),
                          shutil.which("kiln"))
    if not kiln or not Path(kiln).is_file():
        log("no kiln binary: pass --kiln PATH or set KILN_BIN (built here: cargo build --release -p kiln)")
        return 2
    if kiln.endswith(".xz"):
        # scripts/gpu-payload carries the binary xz-compressed (the device takes 64 MiB in all).
        import lzma
        unpacked = work / "kiln"
        with lzma.open(kiln) as src, open(unpacked, "wb") as dst:
            shutil.copyfileobj(src, dst)
        unpacked.chmod(0o755)
        kiln = str(unpacked)
    # The fixtures are stored packed (tools/fixtures/oracle_pack.py): unpack them in place first.
    t0 = time.time()
    n = oracle_pack.unpack(REPO / "fixtures" / "oracle", quiet=True)
    log(f"fixtures: unpacked {n} packed files in {time.time() - t0:.1f} s")
    template = REPO / "fixtures/oracle/pipelines/flux1_schnell"
    oracle_case = REPO / "fixtures/oracle/cases/flux1_schnell/basic_square"
    case = json.loads((oracle_case / "call.json").read_text())
    if small:
        kw = case["call_kwargs"]
        call = {"height": kw["height"], "width": kw["width"], "steps": kw["num_inference_steps"], "dtype": "f32",
                "seed": case["seed"], "prompt": kw["prompt"], "max_sequence_length": kw["max_sequence_length"]}
        device = "cpu"
    else:
        call = {"height": 1024, "width": 1024, "steps": 4, "dtype": "bf16", "seed": 0, "prompt": PROMPT,
                "max_sequence_length": 256}
        device = "cuda"
    report = {"mode": "small" if small else "full", "device": device, "call": call, "kiln": kiln,
              "budget_s": budget, "timings": [], "images": {}, "checks": [], "reference": REFERENCE}
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    failures = []

    try:
        # 1. The machine, the python, the plugin.
        if not small:
            smi = run(log, "nvidia-smi", ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                           "--format=csv,noheader"], 20)
            report["device_name"] = smi["tail"].strip().splitlines()[-1] if smi["rc"] == 0 else None
            info = find_cuda_plugin(a.python)
            report["python"] = info
            plugin = info.get("plugin", {}).get("path")
            log(f"CUDA plugin: {plugin or 'NOT FOUND'} ({info.get('plugin', {}).get('how')}); {info.get('versions')}")
            if not plugin:
                report["checks"].append("no CUDA PJRT plugin in " + a.python + " (pip install jax-cuda13-pjrt)")
                return 1
            env["KILN_PJRT_PLUGIN"] = plugin
            env["KILN_PYTHON"] = a.python

        # 2. kiln selftest.
        st_json = work / "selftest.json"
        dump = work / "hlo-dump"
        st_env = dict(env, KILN_DUMP_HLO=str(dump)) if not small else env
        cmd = [kiln, "selftest", "--device", device, "--json", st_json]
        oracle = a.oracle or (Path(kiln).parent / "oracle" if (Path(kiln).parent / "oracle").is_dir() else REPO / "fixtures/oracle")
        if Path(oracle).is_dir():
            cmd += ["--oracle", oracle]
        r = run(log, "selftest", cmd, min(180, left()), env=st_env)
        try:
            st = json.loads(st_json.read_text())
            report["selftest"] = {
                "summary": f"{st['passed']} passed, {st['failed']} failed, {st['skipped']} skipped in {st['seconds']:.1f} s",
                "failed_rows": [f"[{x['section']}] {x['check']}: {x['detail']}" for x in st["rows"] if x["status"] == "FAIL"],
                "rows": st["rows"],
            }
        except (OSError, ValueError, KeyError):
            report["selftest"] = {"error": f"rc {r['rc']}: {r['tail'][-600:]}"}
        if r["rc"] != 0:
            failures.append("selftest")

        # 3. JAX's lowering of one cuDNN attention call next to kiln's (GPU only).
        if not small:
            # The selftest's "attention head 64 no mask bf16" program: q, k, v [1, 2, 16, 64], scale 1/8.
            kiln_line = None
            for f in sorted(dump.glob("*attention*.mlir")) if dump.is_dir() else []:
                line = custom_call_line(f.read_text())
                if line and "tensor<1x2x16x64xbf16>" in line and '\\"CAUSAL\\"' not in line:
                    kiln_line = line
                    break
            jr = run(log, "jax cuDNN attention lowering", [a.python, "-c", JAX_TEMPLATE], min(90, left()), env=env,
                     full=True)
            report["cudnn_template"] = compare_templates(kiln_line, custom_call_line(jr["tail"]) if jr["rc"] == 0 else None)
            if jr["rc"] != 0:
                report["cudnn_template"]["jax_error"] = jr["tail"][-800:]

        # 4. The pipeline folder.
        model = work / ("flux1-schnell-tiny" if small else "flux1-schnell-random")
        t = time.time()
        if small:
            source, dtypes = folder_mod.copy_source(template)
            report["folder"] = {"stats": folder_mod.build(template, model, {}, source, dtypes["transformer"])}
            problems = folder_mod.check_against(template)
            report["checks"].append(f"parameter enumeration vs the fixture's files: {'same' if not problems else problems[:5]}")
            if problems:
                failures.append("parameter enumeration")
        elif a.reuse_folder and (model / "model_index.json").is_file() and (model / ".complete").is_file():
            report["folder"] = {"reused": True}
        else:
            builder = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import folder, json; from pathlib import Path; "
                       f"s = folder.build(Path({str(template)!r}), Path({str(model)!r}), folder.FULL_SIZES, "
                       f"folder.torch_random_source('cuda'), 'BF16'); print(json.dumps(s)); "
                       f"Path({str(model)!r}, '.complete').write_text('ok')")
            r = run(log, "build the full-size folder", [a.python, "-c", builder], min(240, left()), env=env)
            report["folder"] = {"build": r}
            if r["rc"] != 0:
                failures.append("folder")
                raise RuntimeError("the full-size folder could not be built")
            report["folder"]["stats"] = json.loads(r["tail"].strip().splitlines()[-1])
        report["folder"]["path"] = str(model)
        report["folder"]["seconds"] = round(time.time() - t, 1)

        # 5. kiln generate, each mode from an empty program cache: compiled now (the headline), eager
        # after diffusers (the first step cut when the run is late).
        gen = [kiln, "generate", "--model", model, "--prompt", call["prompt"], "--height", call["height"],
               "--width", call["width"], "--num-inference-steps", call["steps"], "--guidance-scale", "0",
               "--max-sequence-length", call["max_sequence_length"], "--seed", call["seed"],
               "--dtype", call["dtype"], "--device", device]

        def kiln_mode(mode, compile_flag, calls, cap):
            cache = work / f"kiln-cache-{mode}"
            shutil.rmtree(cache, ignore_errors=True)
            timings, png = work / f"kiln-{mode}.json", out / f"kiln-{mode}.png"
            png.unlink(missing_ok=True)
            if left() < 30:
                report["timings"].append({"engine": "kiln", "mode": mode, "error": "skipped: out of time"})
                return
            r = run(log, f"kiln {mode}", [*gen, "--compile", compile_flag, "--calls", calls, "--timings", timings,
                                          "--output", png], min(cap, left()), env=dict(env, KILN_CACHE_DIR=str(cache)))
            row = {"engine": "kiln", "mode": mode, **summarize_kiln(timings)}
            if r["rc"] != 0:
                last = r["tail"].strip().splitlines()[-1][:300] if r["tail"].strip() else ""
                row["error"] = f"rc {r['rc']}: {last}"
                failures.append(f"kiln {mode}")
            report["timings"].append(row)

        kiln_mode("compiled", "full", 3, 240)

        # 6. diffusers on the same folder, device, call and seed.
        py_env = dict(env)
        if a.skip_diffusers:
            report["diffusers_note"] = "skipped (--skip-diffusers)"
        elif not python_has(a.python, "torch", py_env):
            report["diffusers_note"] = f"not run: {a.python} has no torch"
        else:
            if not python_has(a.python, "diffusers", py_env) and a.wheels and Path(a.wheels).is_dir():
                target = work / "pydeps"
                wheels = sorted(str(p) for p in Path(a.wheels).glob("*.whl"))
                run(log, "install diffusers (no deps, no index)", [a.python, "-m", "pip", "install", "--quiet",
                    "--no-deps", "--no-index", "--target", target, *wheels], min(120, left()), env=py_env)
                py_env["PYTHONPATH"] = f"{target}{os.pathsep}{py_env.get('PYTHONPATH', '')}"
            if not python_has(a.python, "diffusers", py_env):
                report["diffusers_note"] = f"not run: diffusers is not installed for {a.python} (and no --wheels)"
            elif left() < 40:
                report["diffusers_note"] = "not run: out of time"
            else:
                result = work / "diffusers.json"
                modes = "eager" if small else "eager,torch.compile"
                # Leave time for kiln eager after diffusers.
                diffusers_s = max(left() - (40 if small else 90), 40)
                worker = [a.python, str(Path(__file__).resolve()), "--diffusers-worker", "--out", out,
                          "--w-model", model, "--w-device", device, "--w-dtype", call["dtype"],
                          "--w-prompt", call["prompt"], "--w-modes", modes, "--w-result", result,
                          "--w-deadline", time.time() + diffusers_s - 5, "--w-compile-reserve", 150, "--w-height", call["height"],
                          "--w-width", call["width"], "--w-steps", call["steps"], "--w-seed", call["seed"],
                          "--w-max-sequence-length", call["max_sequence_length"], "--w-calls", 2 if small else 3]
                r = run(log, "diffusers", worker, diffusers_s, env=py_env)
                res = json.loads(result.read_text()) if result.is_file() else {}
                report["diffusers"] = {k: v for k, v in res.items() if k != "modes"}
                for mode in modes.split(","):
                    row = {"engine": "diffusers", "mode": mode, **summarize_diffusers(res, mode)}
                    report["timings"].append(row)
                if r["rc"] != 0:
                    report["diffusers_note"] = f"rc {r['rc']}: {r['tail'][-400:]}"

        kiln_mode("eager", "none", 2, 200)
    except Exception as e:  # noqa: BLE001 - the report says what broke
        log(f"stopped: {type(e).__name__}: {e}")
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        # 7. Images and the verdicts.
        pngs = {p.stem: p for p in sorted(out.glob("*.png"))}
        pairs = [("kiln-eager", "kiln-compiled"), ("kiln-compiled", "diffusers-eager"), ("kiln-eager", "diffusers-eager"),
                 ("kiln-compiled", "diffusers-compile"), ("diffusers-eager", "diffusers-compile")]
        for x, y in pairs:
            if x in pngs and y in pngs:
                report["images"][f"{x} vs {y}"] = image_delta(pngs[x], pngs[y])
        if small:
            golden = oracle_case / "image_0.png"
            for x in ("kiln-eager", "kiln-compiled"):
                if x in pngs:
                    report["images"][f"{x} vs diffusers' oracle image"] = image_delta(pngs[x], golden)
            agree = [d for k, d in report["images"].items() if "kiln" in k]
            ok = len(agree) >= 3 and all(d.get("max_abs", 99) <= 1 and d.get("differing_fraction", 1) <= 0.01 for d in agree)
            report["checks"].append(f"images agree (kiln eager, compiled, diffusers' image; <= 1 level in <= 1 %): {ok}")
            if not ok:
                failures.append("images")
            if "diffusers_note" in report:
                report["diffusers_note"] += "; kiln's images were compared with the image diffusers made for the oracle case"
        else:
            compiled = next((r for r in report["timings"] if r["engine"] == "kiln" and r["mode"] == "compiled"), {})
            if compiled.get("e2e_s") is not None:
                met = compiled["e2e_s"] <= REFERENCE["goal_e2e_s"]
                report["goal"] = f"kiln compiled {compiled['e2e_s']:.3f} s end to end: {'met' if met else 'not met'}"
        report["failures"] = failures
        report["total_s"] = time.time() - start
        write_report(out, report)
        if not a.work and small:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if (small and failures) else 0


if __name__ == "__main__":
    sys.exit(main())
