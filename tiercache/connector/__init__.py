"""The engine-agnostic connector API (`api`) and its two sides: `scheduler` (one per engine) and `worker` (one
per rank)."""
