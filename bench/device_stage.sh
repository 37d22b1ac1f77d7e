#!/usr/bin/env bash
# bench/device_stage.sh: here, before a device run, put in .gpu/ what bench/device.sh installs there.
#
# The device machine reaches no package registry, and one call carries at most 64 MiB with the working
# tree. So the wheels it lacks (MLX's CUDA 13 build, ~90 MB; mlx-lm; the HTTP and gRPC stacks at this
# project's versions) and the SmolLM2 folder (~100 MB, from `make real-model`) go into one tar archive,
# cut into pieces of PIECE bytes, each in its own folder .gpu/pN (ignored by git). Carry .gpu/p1 in one
# call, .gpu/p2 in the next while the machine is still warm (ignored paths stay there between calls),
# and so on; the last call runs bench/device.sh, which joins the pieces. The tracked models/default
# (~30 MB) travels with every call: to make room, take it out of the index first (see docs/gpu.md).
set -eu
cd "$(dirname "$0")/.."
PIECE=${PIECE:-60000000}
WHEELS="mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0
pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 gguf==0.19.0"
# The device's python3 is CPython 3.12 on Linux x86_64 (glibc 2.35 or later).
PLATFORMS="--platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
[ -f models/smollm2/model.safetensors ] || { echo "models/smollm2 is missing: make real-model"; exit 2; }
rm -rf .gpu .gpu-build
mkdir -p .gpu-build/wheels
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLATFORMS -d .gpu-build/wheels $WHEELS
cp -r models/smollm2 .gpu-build/smollm2
tar -C .gpu-build -cf .gpu-build/stage.tar wheels smollm2
mkdir -p .gpu
split -b "$PIECE" -d -a 1 .gpu-build/stage.tar .gpu/part.
for piece in .gpu/part.*; do
    n=$((${piece##*.} + 1))
    mkdir -p ".gpu/p$n"
    mv "$piece" ".gpu/p$n/"
done
rm -rf .gpu-build
ls -la .gpu/p*
