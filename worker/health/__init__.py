"""A worker's health: heartbeat, watchdog probe, hang guard, the liveness check, start failures."""
