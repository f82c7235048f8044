"""`rayless tinker-server`: the Tinker training API (the official `tinker` SDK's REST calls) served on this
machine's torchrun ranks and engines. See docs/tinker.md."""
