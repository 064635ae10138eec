"""Benchmarks: one module per suite, each writing ``DIR/SUITE.json`` (contracts in DESIGN.md)."""
