from flowc.entry import main

main()
