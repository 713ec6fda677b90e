"""train-ledger's prediction model: bytes per rank and per state, bytes and counts per collective."""
