from kvplane.cli import main

main()
