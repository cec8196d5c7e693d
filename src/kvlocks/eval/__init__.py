"""Evaluation: decode loops, the demo, (later) task generators, metrics and runners."""
