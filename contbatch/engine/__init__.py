"""The engine: requests -> scheduler (+ block manager) -> model runner -> outputs."""
