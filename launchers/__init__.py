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


def write_file(path: str, text: str, mode: int = 0o644) -> str:
    """Write a generated file as a new file renamed over `path`: never through what is there (a
    symlink at the path is replaced, its target untouched), never half-written. Returns the path."""
    import os

    from records import remove_stale_tmp

    remove_stale_tmp(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)  # the umask does not decide a script's execute bit
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return path


def open_new(path: str):
    """A log file opened for writing as a new file: an existing file or symlink at `path` is removed
    first (a symlink's target is never truncated). Returns a binary-safe text handle."""
    import os

    if os.path.lexists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    return os.fdopen(fd, "w")


def write_script(path: str, text: str) -> str:
    """Write an executable shell script (the dry artifacts a user runs by hand); returns its path."""
    return write_file(path, text, 0o755)
