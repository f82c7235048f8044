"""What a person sees of a run: the start-up board, the progress display and the metrics log. Imports only
`coordinator.lifecycle` and the config; every component may report to it."""
