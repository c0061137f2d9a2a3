"""The worker: one process serves one model on one device. It reads batches from the model's
request stream, runs them under the memory budget and publishes replies (docs/concepts/architecture.md, hops 3-4)."""
