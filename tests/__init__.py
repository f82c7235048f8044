"""The rayless test suite: `unit/` starts no process, `integration/` starts real ones, `support/` is
shared by both (and by `bench/`)."""
