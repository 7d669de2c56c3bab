"""Plain wire formats below both tiers/ and server/: stored chunk format, chunk files, value checks, the codec
pipeline, gRPC framing, data-channel frames and the protobuf stubs."""
