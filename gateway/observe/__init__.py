"""What operators read: health (liveness, readiness), metrics and the status page."""
