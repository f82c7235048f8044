"""Two environments written with the `verifiers` package, trained by rayless through miles' session server."""
