"""An example model package for vramguard: see serving.py and ../models.toml."""
