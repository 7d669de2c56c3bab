"""Engine adapters over tiercache's engine-agnostic connector API (imported as ``tiercache.connectors``)."""
