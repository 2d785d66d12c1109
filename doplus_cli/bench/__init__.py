"""Benchmarks behind `doplus bench`."""
