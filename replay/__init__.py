"""Replay: the Sample record, the rollout dump format, the replay loader and the slime/miles importer.

Modules: `sample` (Sample, SampleStatus, RolloutBatch), `format` (the layout, write_dump, dump_path,
DumpError), `reader` (read_dump, iter_samples, read_header), `loader` (ReplayLoader, ReplayMissingError),
`torch_import` (import/convert of `.pt` dumps; the only module that touches torch, lazily), `slime_sample`
(one slime/miles sample dict as a Sample), `tools` (`rayless dump ...`). This package imports neither `coordinator` nor `workers`, and importing it imports nothing else,
so `replay.sample` stays cheap.
"""
