"""The lab's subcommands of ``kvlocks`` (entry-point group ``kvlocks.commands``)."""


def csv_of(kind):
    """An argparse ``type``: ``"a,b,c"`` -> a tuple of ``kind`` values (empty items skipped)."""
    return lambda s: tuple(kind(x) for x in s.split(",") if x)
