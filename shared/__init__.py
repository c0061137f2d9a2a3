"""Code shared by the gateway and the workers: settings, Redis key names, the wire
protocol, the error tree and the model catalogue. Never imports torch or FastAPI."""
