"""vramguard's benchmarks: `python -m bench --help`. Results in bench/RESULTS.md."""
