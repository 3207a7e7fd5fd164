"""The command line (layer 7): parse options, call the layers below, render the result.

main builds the group; commands/ holds the commands; outcome says how one ends,
with exits' statuses. Objects become text or JSON only here (render).
"""
