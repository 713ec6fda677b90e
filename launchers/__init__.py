"""One module per framework, each driving the framework's own code.

A framework module exposes:
    run_rank(cfg, layout, session) -> dict   # one rank of a real run; returns extra record fields
    dry(cfg, layout, out_dir) -> list[str]   # framework-native artifacts for a GPU cluster
"""
FRAMEWORKS = {"megatron": "launchers.megatron", "deepspeed": "launchers.deepspeed", "titan": "launchers.titan"}
