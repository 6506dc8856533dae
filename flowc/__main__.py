from flowc.cli import main

main()
