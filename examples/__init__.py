"""Examples of rayless hooks (importable as `examples.<name>` with the repository root on PYTHONPATH)."""
