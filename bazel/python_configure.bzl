"""Finds the Python interpreter py_binary and py_test run under, and
generates the @local_python repository.

The interpreter is chosen on purpose, not found on PATH: Debian's
/usr/bin/python3 is the one with python3-torch, while a pyenv shim earlier
on PATH (as on these machines) has no torch. Override with
--repo_env=PSTRAIN_PYTHON=/path/to/python3. (The pstrain package itself is
built for no interpreter in particular: its C++ core is loaded with ctypes.)

  @local_python//:defs.bzl        PYTHON (the interpreter's path),
                                  PYTHON_VERSION ("3.11"), PYTHON_SITE (the
                                  directory it installs packages into)
  @local_python//:toolchain       the py_runtime py_binary/py_test run
                                  under (WORKSPACE registers it)
"""

_QUERY = """
import sys, site
print("%d.%d" % sys.version_info[:2])
print(site.getsitepackages()[0])
"""

def _python_configure_impl(repository_ctx):
    python = repository_ctx.os.environ.get("PSTRAIN_PYTHON", "/usr/bin/python3")
    if not repository_ctx.path(python).exists:
        fail("PSTRAIN_PYTHON: no interpreter at %s (deploy/setup.sh installs Debian's python3)" % python)
    result = repository_ctx.execute([python, "-c", _QUERY])
    if result.return_code != 0:
        fail("%s could not describe itself: %s" % (python, result.stderr))
    version, site = result.stdout.strip().split("\n")
    repository_ctx.file("defs.bzl", """
PYTHON = "{python}"
PYTHON_VERSION = "{version}"
PYTHON_SITE = "{site}"
""".format(python = python, version = version, site = site))
    repository_ctx.file("BUILD.bazel", """
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

py_runtime(
    name = "python3_runtime",
    interpreter_path = "{python}",
    python_version = "PY3",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":python3_runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
""".format(python = python))

python_configure = repository_rule(
    implementation = _python_configure_impl,
    environ = ["PSTRAIN_PYTHON"],
    local = True,
)
