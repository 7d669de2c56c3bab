"""tiercache: tiered KV-cache offloading for LLM serving."""
__version__ = "0.1.0"
