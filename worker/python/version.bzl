"""The pstrain Python package's version, and its wheel's tag.

WHEEL_TAG: any CPython 3 (the C++ core is loaded with ctypes), on x86-64
Linux with glibc >= 2.34: the newest GLIBC_ symbol any shipped library needs
on a Debian 12 build (make_wheel.py computes it and refuses a mismatch).
"""

PSTRAIN_VERSION = "0.5.0"
WHEEL_TAG = "py3-none-manylinux_2_34_x86_64"
