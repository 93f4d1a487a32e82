"""Generate the Python gRPC stubs for protos/*.proto (placeholder until the service is written)."""

if __name__ == "__main__":
    pass
