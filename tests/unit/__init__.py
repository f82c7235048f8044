"""Tests that start no process: pure functions, in-process servers (the FAKE engine), unlaunched groups."""
