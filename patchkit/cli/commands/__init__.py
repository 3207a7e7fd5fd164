"""One module per command, or per group of commands that share their plumbing.

``patchkit.cli.main`` registers each on the `patchkit` group.
"""
