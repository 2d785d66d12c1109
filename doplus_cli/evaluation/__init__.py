"""Evaluation of models: the TOFU and real-world suites, lm-evaluation-harness benchmarks, reports."""
