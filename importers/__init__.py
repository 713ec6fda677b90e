"""Launch configs users already run, imported as train-ledger overrides (importers/megatron.py: a
Megatron-LM pretrain_gpt.py command line). `python -m importers --help`."""
