"""The batch path and delivery: read a batch (the batch window), serve it under the memory budget,
publish replies and acks, reclaim the entries of dead workers."""
