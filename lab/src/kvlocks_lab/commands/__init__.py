"""The lab's subcommands of ``kvlocks`` (entry-point group ``kvlocks.commands``)."""
