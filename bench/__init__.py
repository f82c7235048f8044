"""Benchmarks, each printing its figures beside a floor measured in the same run.

Run each as a module from the repository root (`python -m bench.<name>`), so that it imports the project and
`tests.support` like any other package.
"""
