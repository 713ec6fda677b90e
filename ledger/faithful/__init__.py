"""The faithful ledgers, a package per framework; importing this registers the three (ledger/frameworks.py)."""
from ledger.faithful import megatron, deepspeed, titan  # noqa: F401, I001  (registration order: the tables' order
