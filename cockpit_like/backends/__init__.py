"""How the needs of quantities are met: BackPACK extensions and per-sample reductions."""
