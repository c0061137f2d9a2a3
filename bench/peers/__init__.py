"""Servers the benchmark holds vramguard against; each runs as its own process on BENCH_PORT."""
