"""vramguard's benchmarks (issue 6): `python -m bench --help`. Results in bench/RESULTS.md."""
