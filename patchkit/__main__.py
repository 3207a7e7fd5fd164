from patchkit.cli.entry import main

main()
