"""Pure tensor math used by the quantities (no training loop, no BackPACK state)."""
