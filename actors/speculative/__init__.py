"""Speculative decoding inside a worker: draft proposers and verification."""
