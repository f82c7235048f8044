"""The run's status: the status server (`/status`, `/metrics`, the page) and `rayless status` (docs/observability.md)."""
