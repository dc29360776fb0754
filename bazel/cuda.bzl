"""cuda_library: compiles .cu files with nvcc into a cc_library.

    load("//bazel:cuda.bzl", "cuda_library")

    cuda_library(
        name = "my_kernels",
        srcs = ["my_kernels.cu"],
        hdrs = ["my_kernels.h"],   # also visible to nvcc, and exported
        deps = [...],              # cc deps of the *users* (linked in)
    )

How it works: one genrule runs nvcc on every .cu (separate compilation is
off: each object carries its own fat binary and registers its kernels from a
static constructor, so no device link step is needed) and archives the
objects into lib<name>_nvcc.a. A cc_library named <name> wraps the archive,
exports hdrs and links @local_cuda//:cuda_runtime (cudart + cublas, with an
rpath to the toolkit's lib dir, plus its include/ tree).

Target GPUs: `archs` (a list like ["sm_80", "sm_90", "compute_90"]) or, when
it is None, the default from the toolkit detection, which is
sm_80,sm_90,compute_90 unless the build sets
--repo_env=PSTRAIN_CUDA_ARCHS=... . sm_XY embeds machine code for that GPU
generation (it also runs on later minor versions: sm_80 code runs on 8.6 and
8.9); compute_XY embeds PTX that the driver JIT-compiles for GPUs newer than
any sm_XY listed (e.g. Blackwell from compute_90).

nvcc gets -std=c++17 -O3 -Xcompiler -fPIC (the objects end up in shared
libraries and PIE executables), -lineinfo (profilers map SASS to source at
no run-time cost), -I for the workspace root and the genfiles root, then
`nvcc_flags`. The host compiler is nvcc's default (g++ on PATH).

Only usable when @local_cuda//:defs.bzl has CUDA_ENABLED; guard calls with
it and give the targets a CPU-only alternative otherwise (kernels/BUILD.bazel
does).
"""

load("@local_cuda//:defs.bzl", "CUDA_ENABLED", "CUDA_WHY_DISABLED", "DEFAULT_CUDA_ARCHS", "NVCC")

def cuda_gencode_flags(archs):
    """nvcc -gencode flags for a list of sm_XY / compute_XY names."""
    flags = []
    for arch in archs:
        kind, _, number = arch.partition("_")
        if kind not in ["sm", "compute"] or not number.rstrip("af").isdigit():
            fail("cuda arch '%s' is not sm_XY or compute_XY" % arch)
        flags.append("-gencode=arch=compute_%s,code=%s_%s" % (number, kind, number))
    return flags

def cuda_library(
        name,
        srcs,
        hdrs = [],
        deps = [],
        archs = None,
        nvcc_flags = [],
        visibility = None,
        testonly = False,
        tags = []):
    """A cc_library built from .cu sources with nvcc; see the module doc."""
    if not CUDA_ENABLED:
        fail("cuda_library(%s): this build has no CUDA toolkit (%s); guard with CUDA_ENABLED" %
             (name, CUDA_WHY_DISABLED))
    for src in srcs:
        if not src.endswith(".cu"):
            fail("cuda_library(%s): srcs must be .cu files, got %s" % (name, src))

    flags = [
        "-std=c++17",
        "-O3",
        "-Xcompiler=-fPIC",
        "-Xcompiler=-Wall",
        "-lineinfo",
        "-I.",
        "-I$(GENDIR)",
    ] + cuda_gencode_flags(archs if archs != None else DEFAULT_CUDA_ARCHS) + nvcc_flags

    archive = "lib%s_nvcc.a" % name
    compile_steps = [
        "%s %s -c $(location %s) -o $$tmp/%d.o" % (NVCC, " ".join(flags), src, i)
        for i, src in enumerate(srcs)
    ]
    native.genrule(
        name = name + "_nvcc",
        srcs = srcs + hdrs,
        outs = [archive],
        cmd = " && ".join([
            "tmp=$$(mktemp -d)",
            "trap 'rm -rf \"$$tmp\"' EXIT",
        ] + compile_steps + [
            # Archived in the scratch dir, then moved: ar's own temporary
            # file never lands in the output tree.
            "ar rcs $$tmp/lib.a $$tmp/*.o",
            "mv -f $$tmp/lib.a $@",
        ]),
        message = "nvcc %s" % name,
        testonly = testonly,
        tags = tags,
        visibility = ["//visibility:private"],
    )

    # linkstatic: the archive goes straight into each binary, so the
    # kernels are never split from their users across shared objects.
    native.cc_library(
        name = name,
        srcs = [archive],
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cuda_runtime"],
        linkstatic = 1,
        testonly = testonly,
        tags = tags,
        visibility = visibility,
    )
