from flowc.entry import guard_start_up

guard_start_up()  # before the heavy imports: Ctrl-C from here on ends quietly (flowc.entry)

from flowc.entry import main  # noqa: E402

main()
