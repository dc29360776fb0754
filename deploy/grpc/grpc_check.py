#!/usr/bin/python3
"""Asks a ps_server what a probe or an operator wants to know, over gRPC:

  deploy/grpc/grpc_check.py localhost:5001                  # health: SERVING?
  deploy/grpc/grpc_check.py localhost:5000 pstrain.ParameterServer
  deploy/grpc/grpc_check.py --list localhost:5000           # reflection
  deploy/grpc/grpc_check.py --tls_ca=ca.pem --tls_cert=client.pem \
      --tls_key=client.key localhost:5000                   # mutual TLS

Health (grpc.health.v1.Health/Check) prints the serving status and exits 0
when it is SERVING, 1 otherwise, 2 when the server cannot be asked (as
grpc_health_probe does). --list prints the services that server reflection
(v1, else v1alpha) names, one a line. Needs only Debian's python3-grpcio:
the few protobuf fields involved are encoded here by hand, so no generated
code or .proto files are needed.
"""
import argparse
import sys

import grpc

SERVING_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING",
                  3: "SERVICE_UNKNOWN"}


def varint(n):
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def string_field(number, text):
    data = text.encode()
    return varint(number << 3 | 2) + varint(len(data)) + data


def fields(message):
    """(field number, value) of a protobuf message: int or bytes."""
    i = 0
    while i < len(message):
        key, i = read_varint(message, i)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, i = read_varint(message, i)
        elif wire_type == 2:
            length, i = read_varint(message, i)
            value, i = message[i:i + length], i + length
        elif wire_type == 1:
            value, i = message[i:i + 8], i + 8
        elif wire_type == 5:
            value, i = message[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {wire_type} not expected")
        yield number, value


def read_varint(data, i):
    shift = result = 0
    while True:
        byte = data[i]
        i += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, i


def read(path):
    with open(path, "rb") as f:
        return f.read()


def channel(target, args):
    if args.tls_ca:
        # A mutual-TLS server (--tls_client_ca) wants a client certificate.
        credentials = grpc.ssl_channel_credentials(
            root_certificates=read(args.tls_ca),
            private_key=read(args.tls_key) if args.tls_key else None,
            certificate_chain=read(args.tls_cert) if args.tls_cert else None)
        options = []
        if args.tls_server_name:
            options.append(("grpc.ssl_target_name_override",
                            args.tls_server_name))
        return grpc.secure_channel(target, credentials, options=options)
    return grpc.insecure_channel(target)


def health(target, service, args):
    with channel(target, args) as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check")
        response = check(string_field(1, service) if service else b"",
                         timeout=args.timeout_s)
    status = dict(fields(response)).get(1, 0)
    print(SERVING_STATUS.get(status, f"status {status}"))
    return 0 if status == 1 else 1


def list_services(target, args):
    # ServerReflectionRequest.list_services (field 7); the answer's
    # list_services_response (6) holds ServiceResponse (1) names (1).
    request = string_field(7, "*")
    with channel(target, args) as ch:
        for version in ("v1", "v1alpha"):
            info = ch.stream_stream(
                f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo")
            try:
                responses = list(info(iter([request]), timeout=args.timeout_s))
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    continue
                raise
            for response in responses:
                for number, value in fields(response):
                    if number == 7:
                        raise RuntimeError(f"reflection error: {value!r}")
                    if number != 6:
                        continue
                    for _, service in fields(value):
                        print(dict(fields(service))[1].decode())
            return 0
    print(f"{target}: no server reflection on this port (ps_server's "
          "--health_port serves health only)", file=sys.stderr)
    return 2


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="host:port")
    parser.add_argument("service", nargs="?", default="",
                        help='service to check (default "": the server)')
    parser.add_argument("--list", action="store_true",
                        help="list the services (server reflection)")
    parser.add_argument("--tls_ca", help="PEM CA: dial TLS, checked against it")
    parser.add_argument("--tls_cert", help="PEM client certificate, for a "
                        "mutual-TLS server (with --tls_key)")
    parser.add_argument("--tls_key", help="PEM private key of --tls_cert")
    parser.add_argument("--tls_server_name",
                        help="the name the server's certificate must hold, "
                        "when it is not the host dialled")
    parser.add_argument("--timeout_s", type=float, default=5,
                        help="deadline of each call (default 5)")
    args = parser.parse_args()
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls_cert and --tls_key go together")
    if (args.tls_cert or args.tls_server_name) and not args.tls_ca:
        parser.error("--tls_cert, --tls_key and --tls_server_name need --tls_ca")
    try:
        if args.list:
            return list_services(args.target, args)
        return health(args.target, args.service, args)
    except grpc.RpcError as e:
        print(f"{args.target}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
