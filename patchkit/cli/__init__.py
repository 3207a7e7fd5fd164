"""The command line (layer 6): parse options, call one layer below, render the result.

Objects become text or JSON only here (render).
"""
