"""The engine: parse and apply diffs, read and write a tree safely, record and undo.

Layer 1 (primitives: errors, safepath, fsutil, signals, hunks) knows nothing
of vLLM or the catalogue; layer 3 (state, transaction, decide, operations,
bytecode) runs apply and revert on a tree from the catalogue's patches.
Nothing here imports the CLI, diagnosis or proof packages.
"""
