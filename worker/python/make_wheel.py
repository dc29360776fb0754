#!/usr/bin/python3
"""Writes the pstrain wheel: the package's Python files, libpstrain.so and
every shared library it needs that a Linux host does not provide by itself,
beside it (what auditwheel does for manylinux wheels; libpstrain.so's
DT_RPATH of $ORIGIN finds them all, dependencies of dependencies included),
so that ``pip install`` into any CPython 3 environment on an x86-64 Linux
host with glibc and libstdc++ at least as new as this build's works with
nothing else installed.

Left to the host, as manylinux does: glibc (libc, libm, libpthread, libdl,
librt, the loader), libgcc_s and libstdc++. Shipping a second libstdc++
would put two of them in one process beside torch's.

The tag is py3-none-manylinux_2_<N>_x86_64: any CPython 3 (the library is
loaded with ctypes, not as an extension module), glibc >= 2.N, N being the
newest GLIBC_ symbol version any shipped file needs. Only the standard
library, ldd and objdump are used, so the GPU host's check assembles the
same wheel from a bundle (deploy/gpu/check.sh).

  make_wheel.py --version=V --lib=libpstrain.so --out_dir=DIR \
      --package_dir=DIR FILE.py...
Prints the wheel's path.
"""

import argparse
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

# What the host provides (the manylinux policy's libraries we use).
HOST_LIBRARIES = re.compile(
    r"^(linux-vdso|ld-linux|libc|libm|libpthread|libdl|librt|libutil|"
    r"libgcc_s|libstdc\+\+)\.so")


def needed_libraries(library):
    """(soname, path) of every shared library `library` loads, from ldd."""
    out = subprocess.run(["ldd", library], check=True, capture_output=True,
                         text=True).stdout
    found = []
    for line in out.splitlines():
        match = re.match(r"\s*(\S+) => (\S+) \(", line)
        if match is None:
            if "not found" in line:
                sys.exit(f"make_wheel.py: {library}: {line.strip()}")
            continue
        soname, path = match.groups()
        if not HOST_LIBRARIES.match(soname):
            found.append((soname, path))
    return found


def glibc_floor(paths):
    """The newest GLIBC_x.y symbol version any of `paths` needs."""
    newest = (2, 17)
    for path in paths:
        out = subprocess.run(["objdump", "-T", path], check=True,
                             capture_output=True, text=True).stdout
        for major, minor in re.findall(r"GLIBC_(\d+)\.(\d+)", out):
            newest = max(newest, (int(major), int(minor)))
    return newest


def record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
    return f"{path},sha256={digest.rstrip(b'=').decode()},{len(data)}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", required=True)
    parser.add_argument("--lib", required=True)
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--out_name", default="",
                        help="the file name to write, which must carry the "
                        "tag this computes (a build rule names it ahead)")
    parser.add_argument("python_files", nargs="+")
    args = parser.parse_args()

    staging = tempfile.mkdtemp(prefix="pstrain_wheel.")
    try:
        lib_dir = os.path.join(staging, "pstrain", "_lib")
        os.makedirs(lib_dir)
        for path in args.python_files:
            shutil.copy(path, os.path.join(staging, "pstrain",
                                           os.path.basename(path)))
        shipped = [os.path.join(lib_dir, "libpstrain.so")]
        shutil.copy(args.lib, shipped[0])
        for soname, path in needed_libraries(args.lib):
            target = os.path.join(lib_dir, soname)
            shutil.copy(path, target)
            shipped.append(target)
        for path in shipped:
            os.chmod(path, 0o755)
        major, minor = glibc_floor(shipped)
        tag = f"py3-none-manylinux_{major}_{minor}_x86_64"
        name = f"pstrain-{args.version}-{tag}.whl"
        if args.out_name and args.out_name != name:
            sys.exit(f"make_wheel.py: the wheel is {name}, the build asked "
                     f"for {args.out_name}: update the name in its BUILD "
                     "file (the glibc floor changed)")
        dist_info = f"pstrain-{args.version}.dist-info"
        metadata = (
            "Metadata-Version: 2.1\n"
            "Name: pstrain\n"
            f"Version: {args.version}\n"
            "Summary: Train PyTorch models on pstrain's parameter servers\n"
            "Requires-Python: >=3.9\n"
            "License: Apache-2.0\n"
            "Description-Content-Type: text/plain\n\n"
            "The pstrain client (C++, loaded with ctypes) and pstrain.torch.\n"
            "Needs numpy and torch in the environment (not declared, so that\n"
            "pip never replaces the torch a user has).\n")
        wheel = ("Wheel-Version: 1.0\n"
                 "Generator: pstrain make_wheel.py\n"
                 "Root-Is-Purelib: false\n"
                 f"Tag: {tag}\n")
        os.makedirs(os.path.join(staging, dist_info))
        for file_name, text in (("METADATA", metadata), ("WHEEL", wheel),
                                ("top_level.txt", "pstrain\n")):
            with open(os.path.join(staging, dist_info, file_name), "w") as f:
                f.write(text)
        os.makedirs(args.out_dir, exist_ok=True)
        out = os.path.join(args.out_dir, name)
        records = []
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
            for root, _, files in sorted(os.walk(staging)):
                for file_name in sorted(files):
                    path = os.path.join(root, file_name)
                    arcname = os.path.relpath(path, staging)
                    with open(path, "rb") as f:
                        data = f.read()
                    info = zipfile.ZipInfo(arcname, (2026, 1, 1, 0, 0, 0))
                    info.external_attr = (os.stat(path).st_mode & 0o777) << 16
                    info.compress_type = zipfile.ZIP_DEFLATED
                    archive.writestr(info, data)
                    records.append(record_line(arcname, data))
            records.append(f"{dist_info}/RECORD,,")
            archive.writestr(
                zipfile.ZipInfo(f"{dist_info}/RECORD", (2026, 1, 1, 0, 0, 0)),
                "\n".join(records) + "\n")
        print(out)
    finally:
        shutil.rmtree(staging)


if __name__ == "__main__":
    main()
