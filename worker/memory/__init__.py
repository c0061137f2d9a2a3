"""The memory promise: the plan's arithmetic, the budget at run time, device accounting, the
per-GPU ledger, the free-memory check, the simulated CUDA device and its caching allocator, the profile."""
