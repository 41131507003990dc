#!/usr/bin/python3
"""An independent gRPC client for the TLS and API key tests: Debian's python3-grpcio (gRPC's
Python stack over its own core, none of m3serve's C++ client code). It checks health, asks
for the model info and streams one Generate, with raw protobuf bytes (no generated code),
and prints what it got; on an RPC error it prints the status and exits 1."""
import argparse
import sys

import grpc

parser = argparse.ArgumentParser()
parser.add_argument("--server", required=True)
parser.add_argument("--ca", help="PEM CA certificates: TLS")
parser.add_argument("--cert", help="PEM client certificate (mutual TLS)")
parser.add_argument("--key", help="PEM client key (mutual TLS)")
parser.add_argument("--api-key", help="sent as 'authorization: Bearer KEY'")
args = parser.parse_args()


def read(path):
    with open(path, "rb") as f:
        return f.read()


if args.ca:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(args.ca),
        private_key=read(args.key) if args.key else None,
        certificate_chain=read(args.cert) if args.cert else None)
    channel = grpc.secure_channel(args.server, credentials)
else:
    channel = grpc.insecure_channel(args.server)
metadata = [("authorization", "Bearer " + args.api_key)] if args.api_key else None

try:
    # grpc.health.v1.HealthCheckRequest{} -> HealthCheckResponse{status: SERVING} is 08 01.
    health = channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=10)
    print("health", "SERVING" if health == b"\x08\x01" else health.hex())
    info = channel.unary_unary("/m3serve.v1.M3Serve/GetModelInfo")(b"", timeout=10, metadata=metadata)
    print("model_info_bytes", len(info))
    # GenerateRequest{prompt_ids: {ids: [1, 2, 3]}, max_new_tokens: 4}
    request = bytes([0x12, 0x05, 0x0A, 0x03, 1, 2, 3, 0x20, 4])
    replies = list(channel.unary_stream("/m3serve.v1.M3Serve/Generate")(request, timeout=30, metadata=metadata))
    tokens = sum(1 for r in replies if r[:1] == b"\x0a")  # GenerateResponse.tokens
    finished = bool(replies) and replies[-1][:1] == b"\x12"  # GenerateResponse.finished
    print("generate token_messages", tokens, "finished", "yes" if finished else "no")
except grpc.RpcError as e:
    print("error", e.code().name, e.details())
    sys.exit(1)
