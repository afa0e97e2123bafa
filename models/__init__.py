"""Model folders: each subpackage exposes `spec = ModelSpec(...)` (see torchacco/spec.py)."""
