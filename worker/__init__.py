"""The worker: one process serves one model on one device. It reads batches from the model's
request stream, runs them under the memory budget and publishes replies (DESIGN.md hops 3-4)."""
