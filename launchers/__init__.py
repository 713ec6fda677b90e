"""One module per framework, each driving the framework's own code.

A framework module exposes:
    run_rank(cfg, layout, session) -> dict   # one rank of a real run; returns extra record fields
    dry(cfg, layout, out_dir) -> list[str]   # framework-native artifacts for a GPU cluster
"""
# each framework's ledger names its launcher module (ledger/frameworks.py FrameworkLedger.launcher)


def shell_comment(text: str) -> str:
    """One `# ...` line of a generated script: a newline or other control character in the text
    (which would end the comment and start a command) becomes '?'. Values reaching a command line
    are shlex.quote'd where they are written; this guards the comments."""
    return "# " + "".join(ch if ch.isprintable() else "?" for ch in text)


def write_script(path: str, text: str) -> str:
    """Write an executable shell script (the dry artifacts a user runs by hand); returns its path."""
    import os

    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    return path
