"""`tiercache serve`: a gRPC cache server that many engine replicas share (protocol: proto/tiercache.proto)."""
