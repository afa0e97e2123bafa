"""Benchmarks: they print and save their numbers (JSON + markdown); they are not tests."""
