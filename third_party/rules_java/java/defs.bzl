"""Offline stand-in for rules_java: the native rules under their usual names.

Nothing here builds Java; Bazel only needs these names to parse its own JDK
toolchain packages while resolving toolchains for C++ targets.
"""

def java_binary(**attrs):
    native.java_binary(**attrs)

def java_import(**attrs):
    native.java_import(**attrs)

def java_library(**attrs):
    native.java_library(**attrs)

def java_proto_library(**attrs):
    native.java_proto_library(**attrs)

def java_runtime(**attrs):
    native.java_runtime(**attrs)

def java_toolchain(**attrs):
    native.java_toolchain(**attrs)

def java_test(**attrs):
    native.java_test(**attrs)
