"""Layer 4: apply, revert and refresh on a tree: the state file, the crash journal,
the assessment of each patch, the plan, its execution, stale bytecode.
"""
