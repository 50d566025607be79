#!/bin/sh
# Build our native kernels into service/engine/native/libcosyvoice_lite_native.so: the kit's operators
# (service/engine/native/*.c), the fused layers that families share (service/layers/native/*.c) and those one family
# owns (service/families/*/native/*.c, which may include the shared layers' headers); the layers register themselves (service/engine/native/op.h). `make native` and docker/Dockerfile run this one script, so the flags are
# the same everywhere. The kernels pick their instructions at run time (function target attributes and one CPU probe,
# cpu.c), so the library built on one x86-64 host runs on any.
#   sh scripts/build_native.sh            no C compiler: print a notice and exit 0 (the engine runs ONNX Runtime's graphs)
#   sh scripts/build_native.sh --require  no C compiler: fail (the image build installs one)
set -eu
root="$(cd "$(dirname "$0")/.." && pwd)"
kit="$root/service/engine/native"
layers="$root/service/layers/native"
cc="${CC:-cc}"
if ! command -v "$cc" >/dev/null 2>&1; then
    if [ "${1:-}" = "--require" ]; then
        echo "build_native.sh: no C compiler ($cc)" >&2
        exit 1
    fi
    echo "native kernels not built: no C compiler ($cc); ONNX Runtime's graphs run instead (apt-get install gcc)"
    exit 0
fi
"$cc" -O3 -fPIC -shared -std=gnu11 -Wall -Wextra -Werror -I"$kit" -I"$layers" -o "$kit/libcosyvoice_lite_native.so" \
    "$kit"/*.c "$layers"/*.c $(ls "$root"/service/families/*/native/*.c 2>/dev/null) -lpthread
