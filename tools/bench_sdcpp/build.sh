#!/usr/bin/env bash
# Builds stable-diffusion.cpp at its pinned commit (CPU, native ISA) as kiln's benchmark anchor, and makes the
# shallow-wide FLUX.1 test model with its Q8_0 / Q4_K GGUF conversions. The recipe and why each step exists:
# ../shared/tools/sdcpp/README.md.
# usage: SDCPP=<scratch> SDCPP_SRC=<git url or mirror> GGML_SRC=<git url or mirror> tools/bench_sdcpp/build.sh [models]
set -euo pipefail
: "${SDCPP:?set SDCPP to a scratch folder (source, build and models go there)}"
SDCPP_SRC=${SDCPP_SRC:-https://github.com/leejet/stable-diffusion.cpp}
GGML_SRC=${GGML_SRC:-https://github.com/ggml-org/ggml}
SDCPP_COMMIT=97d2990807fe6d558e395f8764198d7c7e7b411c
GGML_COMMIT=8e800cef2948046cc47f9db6090491c6128ca42c
PY=${PY:-python3}
SHARED=${SHARED:-$(cd "$(dirname "$0")/../../.." && pwd)/shared}
TOOLS=$SHARED/tools/sdcpp
mkdir -p "$SDCPP"
cd "$SDCPP"

if [ ! -x "$SDCPP/venv/bin/python" ]; then "$PY" -m venv "$SDCPP/venv"; fi
"$SDCPP/venv/bin/pip" install -q cmake
CMAKE=$SDCPP/venv/bin/cmake

if [ ! -d src/.git ]; then
  git clone -q -n "$SDCPP_SRC" src
  # the vocab headers may be missing from a mirror; they are rebuilt below
  (cd src && git checkout -q "$SDCPP_COMMIT" -- . 2>/dev/null || git checkout -q "$SDCPP_COMMIT" -- . || true)
  rm -rf src/ggml
  git clone -q -n "$GGML_SRC" src/ggml
  (cd src/ggml && git checkout -q "$GGML_COMMIT")
fi
[ "$(cd src && git rev-parse HEAD 2>/dev/null || true)" = "$SDCPP_COMMIT" ] || (cd src && git checkout -q "$SDCPP_COMMIT" -- . 2>/dev/null || true)

vocab=src/src/tokenizers/vocab
if [ ! -s "$vocab/t5.hpp" ] || [ "$(stat -c %s "$vocab/t5.hpp")" -lt 1000 ]; then
  mkdir -p pypi
  "$SDCPP/venv/bin/pip" download -q stable-diffusion-cpp-python==0.4.7 --no-deps \
    --no-binary stable-diffusion-cpp-python -d pypi
  tar xzf pypi/stable_diffusion_cpp_python-0.4.7.tar.gz -C pypi
  "$PY" "$TOOLS/regen_vocab.py" pypi/stable_diffusion_cpp_python-0.4.7/vendor/stable-diffusion.cpp/src/tokenizers/vocab "$vocab"
fi

if [ ! -x src/build/bin/sd-cli ]; then
  (cd src && nice -n 10 "$CMAKE" -S . -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
      -DSD_SERVER_BUILD_FRONTEND=OFF > "$SDCPP/cmake_configure.log" 2>&1 &&
    nice -n 10 "$CMAKE" --build build --config Release --target sd-cli -j"$(nproc)" > "$SDCPP/cmake_build.log" 2>&1)
fi
src/build/bin/sd-cli --version

if [ "${1:-}" = models ]; then
  REFENV=${REFENV:?set REFENV to the diffusers reference environment (torch, diffusers, transformers)}
  M=$SDCPP/models
  if [ ! -s "$M/flux1-wide-1d2s-bf16.safetensors" ]; then
    HF_HUB_OFFLINE=1 "$REFENV/bin/python" "$TOOLS/make_models.py" --out "$M" --diffusers "$M/flux_wide_diffusers" \
      --clip-tokenizer "$SHARED/oracle/data/tokenizers/clip" --t5-tokenizer-json "$SDCPP/$vocab/t5.hpp"
  fi
  for q in q8_0 q4_K; do
    [ -s "$M/flux1-wide-1d2s-$q.gguf" ] || src/build/bin/sd-cli -M convert -m "$M/flux1-wide-1d2s-bf16.safetensors" \
      -o "$M/flux1-wide-1d2s-$q.gguf" --type "$q" -t "$(nproc)"
  done
  ls -la "$M"
fi
