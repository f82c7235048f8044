"""Tests that start real processes on 127.0.0.1: CPU engines, torchrun ranks, sglang-router, CLI
subprocesses."""
