"""Terra: imperative-symbolic co-execution for TensorFlow 2, and memory-balanced pipelines."""
__version__ = "0.1.0"
