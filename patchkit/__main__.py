from patchkit.entry import main

main()
